"""Reading an EP model's experts from a transformers checkpoint, each rank only its own.

transformers' ``from_pretrained`` builds the model on the meta device, then loads the checkpoint
through its weight conversions (the Hub's per-expert keys merged into packed tensors, renamings...)
and, for a parameter that is a ``DTensor``, reads only that rank's shard from the memory-mapped
safetensors files (per-expert keys of other ranks' experts are skipped, a packed tensor is sliced).
:func:`epmoe.from_pretrained` (:mod:`epmoe.compose.pretrained`) loads through exactly that path,
with these steps around transformers' loader::

    meta model --apply_expert_parallel--> local experts, meta, (E/W, ...)
               --as_meta_dtensors-------> meta DTensor (E, ...), Shard(0) over the EP group
               --transformers' loader---> reads rows [r*E/W, (r+1)*E/W) only, converted as usual
               --as_local_parameters----> plain nn.Parameter (E/W, ...), as apply_expert_parallel leaves them

A checkpoint without some expert tensor, or with one of the wrong shape, raises ``ValueError`` on
every rank of the EP group (a rank finds only its own experts broken: :func:`raise_on_every_rank`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epmoe import platform
from epmoe.checkpoint.dcp import expert_dtensor
from epmoe.comm.steps import AGREE, StepChannel, step_timeout_s
from epmoe.ep.state import ep_group_of, sharded_experts


def as_meta_dtensors(model: nn.Module) -> set[str]:
    """Each local expert tensor as a meta ``DTensor`` of all ``E`` experts, ``Shard(0)`` over its EP
    group (transformers' loader then reads this rank's rows only); returns their names."""
    keys, meshes = set(), {}
    for name, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            local = getattr(module, param_name)
            full = expert_dtensor(torch.empty_like(local, device="meta"), state, meshes)
            setattr(module, param_name, nn.Parameter(full, requires_grad=local.requires_grad))
            keys.add(f"{name}.{param_name}" if name else param_name)
    return keys


def load_error(info: Any, expert_keys: set[str]) -> str | None:
    """What is wrong with this rank's experts in the checkpoint, or ``None``."""
    missing = sorted(expert_keys & set(getattr(info, "missing_keys", ())))
    mismatched = sorted(key for key, *_ in getattr(info, "mismatched_keys", ()) if key in expert_keys)
    if missing or mismatched:
        return f"missing or incomplete {missing[:4]}, wrong shape {mismatched[:4]}"
    return None


def raise_on_every_rank(error: str | None, shards: list, model: nn.Module) -> None:
    """Each rank reads only its own experts, so only some may find a broken one: tell the EP group
    (one agreement step, :meth:`~epmoe.comm.steps.StepChannel.agree`, waiting at most
    ``ExpertParallelConfig.timeout``) and raise ``ValueError`` on all of it, the ranks that found a
    broken expert saying which."""
    if shards and shards[0].ep_size > 1:
        group = ep_group_of(model)
        config = next(state for _, _, state in sharded_experts(model)).model.config
        channel = StepChannel(group, 1, timeout_s=step_timeout_s(config.timeout, group), what="EP")
        channel.agree(channel.next_call(AGREE), platform.group_device(group), [], failed=error is not None,
                      caller="epmoe.from_pretrained: the checkpoint does not hold every expert",
                      what_failed="found some of their experts missing or with the wrong shape")
    if error is not None:
        raise ValueError(f"epmoe.from_pretrained: the checkpoint does not hold every expert: EP rank "
                         f"{shards[0].ep_rank if shards else 0}: {error}")


def as_local_parameters(model: nn.Module) -> None:
    """The loaded ``DTensor`` expert parameters as plain local ``nn.Parameter``s."""
    from torch.distributed.tensor import DTensor

    for _, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            param = getattr(module, param_name)
            if isinstance(param, DTensor):
                local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                local._is_hf_initialized = True
                setattr(module, param_name, local)
