"""The mark every expert-sharded parameter carries: what it is a slice of, for a framework that gathers.

A framework that saves by walking ``named_parameters`` (and gathers what it knows to be sharded:
DTensors, DeepSpeed's ``ds_shape``, its own EP marks) would write an EP shard as if it were the
whole tensor. Each packed experts tensor EP sharded, and each PEFT LoRA factor on one once settled
(:mod:`epmoe.ep.lora`), carries a :class:`ShardMark` as the attribute ``epmoe_shard``::

    mark = getattr(param, "epmoe_shard", None)            # None: not expert-sharded
    parts = [...]                                         # every EP rank's param, in EP rank order
    whole = mark.join(parts)                              # the unsharded model's tensor

Expert ``j`` owns ``rows`` consecutive rows along ``experts_dim`` (of the tensor viewed as ``view``);
``unread`` rows past all ``num_experts`` experts' ones hold nothing any expert reads (zero-computation
experts', :func:`epmoe.ep.recognize.zero_experts`): EP does not keep them and ``join`` gives them as
zeros, as ``save_pretrained`` writes them::

    tensor (local shape)                   global_shape      experts_dim  view         rows  unread
    experts.gate_up_proj (e, 2I, H)        (E, 2I, H)        0            None         1     0
    experts.gate_up_proj (e, 2I, H),       (E+Z, 2I, H)      0            None         1     Z
      Z zero-computation experts
    stacked rows: mlp.w1 (e*I, H)          (E*I, H)          0            None         I     0
    lora_A (r*e, in) expert-major          (r*E, in)         0            None         r     0
    lora_B (out, r*e) expert-minor         (out, r*E)        2            (out, r, e)  1     0

``start``, ``stop``: this rank's experts ``[start, stop)`` of ``num_experts``. The mark is an attribute
of the ``nn.Parameter`` object, so it survives wrappers that rename parameters (peft's ``base_layer``,
FSDP2's names); ``copy.deepcopy`` drops it (as it drops every attribute of a parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SHARD_MARK = "epmoe_shard"


@dataclass(frozen=True)
class ShardMark:
    """What one expert-sharded parameter is a slice of (see the module docstring's table): the
    unsharded tensor's ``global_shape``; its experts along ``experts_dim`` of the tensor viewed as
    ``view`` (``None``: as it is), ``rows`` rows each, expert-major, then ``unread`` rows no expert
    reads; this rank holding experts ``[start, stop)`` of ``num_experts``."""

    global_shape: tuple[int, ...]  # the unsharded model's tensor: all num_experts experts, the unread rows
    experts_dim: int  # where the experts are, in the tensor viewed as ``view``
    view: tuple[int, ...] | None  # the local tensor viewed so before its experts_dim is joined (None: as it is)
    start: int  # this rank's first expert
    stop: int  # one past this rank's last expert
    num_experts: int
    rows: int = 1  # rows per expert along experts_dim: I for stacked rows, r for lora_A
    unread: int = 0  # rows past all experts' along experts_dim, never read: not kept by EP, zeros when joined

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The unsharded model's tensor, of :attr:`global_shape`, from ``parts``: every EP rank's tensor
        in EP rank order, each ``stop - start`` experts' rows (viewed as :attr:`view`) along
        :attr:`experts_dim`; the :attr:`unread` rows after them zeros (never read by any expert).
        ``ValueError`` naming ``parts`` where they are not such slices."""
        held = self.stop - self.start
        if len(parts) * held != self.num_experts:
            raise ValueError(
                f"ShardMark.join(parts): expected {self.num_experts // held} parts ({held} of {self.num_experts} "
                f"experts each), got {len(parts)}"
            )
        sizes = sorted({tuple(part.shape) for part in parts})
        fits = len(sizes) == 1 and (self.view is None or math.prod(sizes[0]) == math.prod(self.view))
        if fits:
            parts = parts if self.view is None else [part.reshape(self.view) for part in parts]
            fits = parts[0].dim() > self.experts_dim and parts[0].shape[self.experts_dim] == held * self.rows
        if not fits:
            raise ValueError(
                f"ShardMark.join(parts): expected parts of {held} experts x {self.rows} rows along dim "
                f"{self.experts_dim}{f' of the view {self.view}' if self.view else ''}, got shapes {sizes}"
            )
        if self.unread:
            shape = list(parts[0].shape)
            shape[self.experts_dim] = self.unread
            parts = [*parts, parts[0].new_zeros(shape)]
        whole = torch.cat(parts, dim=self.experts_dim)
        if self.view is None:
            return whole
        if whole.numel() != math.prod(self.global_shape):
            raise ValueError(
                f"ShardMark.join(parts): the parts join to {tuple(whole.shape)}, not global_shape {self.global_shape}"
            )
        return whole.reshape(self.global_shape)


def mark(param: torch.Tensor, shard_mark: ShardMark) -> None:
    setattr(param, SHARD_MARK, shard_mark)


def mark_of(param: torch.Tensor) -> ShardMark | None:
    """``param``'s :class:`ShardMark`, or ``None`` for a parameter that is not expert-sharded."""
    return getattr(param, SHARD_MARK, None)
