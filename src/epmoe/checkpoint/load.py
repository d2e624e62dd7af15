"""Reading an EP model's experts from a transformers checkpoint, each rank only its own.

transformers' ``from_pretrained`` builds the model on the meta device, then loads the checkpoint
through its weight conversions (the Hub's per-expert keys merged into packed tensors, renamings...)
and, for a parameter that is a ``DTensor``, reads only that rank's shard from the memory-mapped
safetensors files (its ``DtensorShardOperation``: per-expert keys of other ranks' experts are never
read, a packed tensor is sliced). :func:`epmoe.from_pretrained` (:mod:`epmoe.compose.pretrained`)
loads through exactly that path, with these steps around transformers' loader::

    meta model --apply_expert_parallel--> local experts, meta, (E/W, ...)
               --as_meta_dtensors-------> meta DTensor (E, ...), Shard(0) over the EP group
               --one_copy_conversions---> the load's converters pack per-expert keys with one copy
               --transformers' loader---> reads rows [r*E/W, (r+1)*E/W) only, converted as usual
               --as_local_parameters----> plain nn.Parameter (E/W, ...), as apply_expert_parallel leaves them

Packing with one copy: from the Hub's layout transformers builds ``gate_up_proj`` of the ``E/W``
local experts with ``MergeModulelist(dim=0)`` (a stacked copy of the ``gate`` pieces, one of the
``up`` pieces) then ``Concatenate(dim=1)`` (a third copy, the packed tensor): one layer's local
``gate_up_proj`` held twice over, freed buffers the allocator may keep. For this load only (a copy
of ``load_config``, no library change), :class:`MergeConcatenate` does both in one: it allocates
the packed ``(E/W, 2I, H)`` tensor and copies each piece (a view of the memory-mapped file) into
its rows, so a rank's private memory grows by its experts' bytes and no more. The model keeps
transformers' own converters for saving (:func:`restore_conversions`).

A checkpoint without some expert tensor, or with one of the wrong shape, raises ``ValueError`` on
every rank of the EP group (a rank finds only its own experts broken: :func:`raise_on_every_rank`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

try:
    from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter
except ImportError:  # transformers is an optional extra; epmoe.from_pretrained needs it
    ConversionOps = object
    Concatenate = MergeModulelist = WeightConverter = None

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


class MergeConcatenate(ConversionOps):
    """transformers' ``MergeModulelist(dim=0)`` then ``Concatenate(dim)`` in one allocation.

    ``convert({pattern: [piece_j, ...]})`` -> ``{target: packed}``: ``n`` pieces per source
    pattern, piece ``j`` of pattern ``p`` of shape ``shape_p``; ``packed[j]`` is the pattern's
    pieces concatenated along ``dim - 1`` (``dim`` counts the stacked axis, as ``Concatenate``'s
    does), in ``source_patterns`` order: the same tensor, dtype included, as the two ops give, each
    piece copied once. Pieces that do not fit (a count or shape that differs) raise ``ValueError``,
    which transformers' loader records as a conversion error, as it does the ops' own errors."""

    def __init__(self, dim: int):
        self.dim = dim

    @torch.no_grad()
    def convert(self, input_dict: dict[str, list[torch.Tensor]], source_patterns: list[str],
                target_patterns: list[str], **kwargs: Any) -> dict[str, torch.Tensor]:
        pieces = [input_dict.pop(pattern) for pattern in source_patterns if pattern in input_dict]
        if len(target_patterns) != 1 or not pieces or not pieces[0]:
            raise ValueError(f"MergeConcatenate: expected pieces for one target, got {len(pieces)} source lists "
                             f"for targets {target_patterns}")
        first = pieces[0][0]
        dim = self.dim if self.dim >= 0 else self.dim + first.dim() + 1  # an axis of the stacked (n, ...) tensor
        shapes = [[tuple(piece.shape) for piece in group] for group in pieces]
        uniform = all(len(set(group)) == 1 and len(group) == len(pieces[0]) for group in shapes)
        rest = {shape[:dim - 1] + shape[dim:] for group in shapes for shape in group}
        if not (1 <= dim <= first.dim() and uniform and len(rest) == 1):
            raise ValueError(f"MergeConcatenate(dim={self.dim}): pieces of shapes "
                             f"{[(len(group), group[0]) for group in shapes]} do not stack then concatenate")
        widths = [group[0][dim - 1] for group in shapes]
        shape = (len(pieces[0]), *first.shape[:dim - 1], sum(widths), *first.shape[dim:])
        dtype = functools.reduce(torch.promote_types, (piece.dtype for group in pieces for piece in group))
        packed = torch.empty(shape, dtype=dtype, device=first.device)
        offset = 0
        for group, width in zip(pieces, widths):
            rows = packed.narrow(dim, offset, width)
            for j, piece in enumerate(group):
                rows[j].copy_(piece)
            offset += width
        return {target_patterns[0]: packed}


def one_copy_conversions(load_config: Any) -> tuple[Any, dict[int, Any]]:
    """``(config, originals)``: a copy of transformers' ``load_config`` whose converters that stack
    then concatenate (``MergeModulelist(dim=0)``, ``Concatenate``: the Hub's per-expert ``gate`` and
    ``up`` keys) do both with :class:`MergeConcatenate`; ``originals`` maps the ``id`` of each such
    converter of the copy to the one it replaces (for :func:`restore_conversions`)."""
    mapping, originals = [], {}
    for converter in load_config.weight_mapping or ():
        ops = getattr(converter, "operations", ())
        if (isinstance(converter, WeightConverter) and len(ops) >= 2 and type(ops[0]) is MergeModulelist
                and ops[0].dim == 0 and type(ops[1]) is Concatenate):
            one_copy = converter.copy(list(converter._original_source_patterns),
                                      list(converter._original_target_patterns),
                                      operations=[MergeConcatenate(ops[1].dim), *ops[2:]])
            originals[id(one_copy)] = converter
            converter = one_copy
        mapping.append(converter)
    return dataclasses.replace(load_config, weight_mapping=mapping), originals


def restore_conversions(model: nn.Module, originals: dict[int, Any]) -> None:
    """The conversions transformers' loader kept on ``model`` (reverted when saving) as the model's
    own converters again, not the load's :func:`one_copy_conversions`."""
    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        model._weight_conversions = [originals.get(id(conversion), conversion) for conversion in used]


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
