"""The mark every expert-sharded parameter carries: what it is a slice of, for a framework that gathers.

A framework that saves by walking ``named_parameters`` (and gathers what it knows to be sharded:
DTensors, DeepSpeed's ``ds_shape``, its own EP marks) would write an EP shard as if it were the
whole tensor. Each packed experts tensor EP sharded, and each PEFT LoRA factor on one once settled
(:mod:`epmoe.ep.lora`), carries a :class:`ShardMark` as the attribute ``epmoe_shard``::

    mark = getattr(param, "epmoe_shard", None)            # None: not expert-sharded
    parts = [...]                                         # every EP rank's param, in EP rank order
    whole = mark.join(parts)                              # the unsharded model's tensor

    experts.gate_up_proj (e, 2I, H)   ShardMark(global_shape=(E, 2I, H), experts_dim=0, view=None, start, stop)
    lora_A (r*e, in)  expert-major    ShardMark(global_shape=(r*E, in),  experts_dim=0, view=None, ...)
    lora_B (out, r*e) expert-minor    ShardMark(global_shape=(out, r*E), experts_dim=2, view=(out, r, e), ...)

``start``, ``stop``: this rank's experts ``[start, stop)`` of ``num_experts``. The mark is an attribute
of the ``nn.Parameter`` object, so it survives wrappers that rename parameters (peft's ``base_layer``,
FSDP2's names); ``copy.deepcopy`` drops it (as it drops every attribute of a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARD_MARK = "epmoe_shard"


@dataclass(frozen=True)
class ShardMark:
    """What one expert-sharded parameter is (see the module docstring)."""

    global_shape: tuple[int, ...]  # the unsharded model's tensor: all num_experts experts
    experts_dim: int  # where the experts are, in the tensor viewed as ``view``
    view: tuple[int, ...] | None  # the local tensor viewed so before its experts_dim is joined (None: as it is)
    start: int  # this rank's first expert
    stop: int  # one past this rank's last expert
    num_experts: int

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every EP rank's tensor (in EP rank order, each holding ``stop - start`` experts) as the
        unsharded model's tensor of :attr:`global_shape`."""
        if self.view is not None:
            parts = [part.reshape(self.view) for part in parts]
        return torch.cat(parts, dim=self.experts_dim).reshape(self.global_shape)


def mark(param: torch.Tensor, shard_mark: ShardMark) -> None:
    setattr(param, SHARD_MARK, shard_mark)


def mark_of(param: torch.Tensor) -> ShardMark | None:
    """``param``'s :class:`ShardMark`, or ``None`` for a parameter that is not expert-sharded."""
    return getattr(param, SHARD_MARK, None)
