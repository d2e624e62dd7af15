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
                                          (cast to the model's dtype if read uncast: a packed layout)

Packing with one copy: from the Hub's layout transformers builds ``gate_up_proj`` of the ``E/W``
local experts with ``MergeModulelist(dim=0)`` (a stacked copy of the ``gate`` pieces, one of the
``up`` pieces) then ``Concatenate(dim=1)`` (a third copy, the packed tensor): one layer's local
``gate_up_proj`` held twice over, freed buffers the allocator may keep; and a load that changes
the dtype casts every piece in the loader's threads, all layers' at once, before the first
conversion. For this load only (a copy of ``load_config``, no library change),
:class:`MergeConcatenate` stacks (and concatenates) in one: it allocates the packed
``(E/W, 2I, H)`` (or ``(E/W, H, I)``) tensor in the parameter's dtype and copies each piece, read
uncast (a view of the memory-mapped file), into its rows, casting as it copies; so a rank's private
memory grows by its experts' bytes and no more. The model keeps transformers' own converters for
saving (:func:`restore_conversions`).

A checkpoint without some expert tensor, or with one of the wrong shape, raises ``ValueError`` on
every rank of the EP group (a rank finds only its own experts broken: :func:`raise_on_every_rank`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

try:
    from transformers.core_model_loading import (
        Concatenate,
        ConversionOps,
        MergeModulelist,
        WeightConverter,
        build_glob_alternation,
    )
except ImportError:  # transformers is an optional extra; epmoe.from_pretrained needs it
    ConversionOps = object
    Concatenate = MergeModulelist = WeightConverter = build_glob_alternation = None

from epmoe import platform
from epmoe.checkpoint.dcp import expert_dtensor
from epmoe.comm.steps import AGREE, StepChannel, step_timeout_s
from epmoe.ep.recognize import set_parameter
from epmoe.ep.state import ep_group_of, sharded_experts


def as_meta_dtensors(model: nn.Module) -> dict[str, torch.dtype]:
    """Each local expert tensor as a meta ``DTensor`` of all ``E`` experts, ``Shard(0)`` over its EP
    group (transformers' loader then reads this rank's rows only); returns their names and dtypes."""
    keys, meshes = {}, {}
    for name, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            local = module.get_parameter(param_name)
            full = expert_dtensor(torch.empty_like(local, device="meta"), state, meshes)
            set_parameter(module, param_name, nn.Parameter(full, requires_grad=local.requires_grad))
            keys[f"{name}.{param_name}" if name else param_name] = local.dtype
    return keys


class MergeConcatenate(ConversionOps):
    """transformers' ``MergeModulelist(dim=0)``, then ``Concatenate(dim)`` unless ``dim`` is
    ``None``, in one allocation, in the target parameter's dtype.

    ``convert({pattern: [piece_j, ...]})`` -> ``{target: packed}``: ``n`` pieces per source
    pattern (one pattern when ``dim`` is ``None``); ``packed[j]`` is the patterns' ``j``-th pieces
    concatenated along ``dim - 1`` (``dim`` counts the stacked axis, as ``Concatenate``'s does), in
    ``source_patterns`` order: the tensor the ops give, each piece copied (and cast) once. Its dtype
    is the target parameter's (``model``'s ``full_layer_name``, as transformers' loader passes
    them), else the pieces' promoted as ``torch.cat`` promotes. Pieces that do not fit (a count or
    shape that differs) raise ``ValueError``, which transformers' loader records as a conversion
    error, as it does the ops' own errors."""

    def __init__(self, dim: int | None):
        self.dim = dim

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, list[torch.Tensor]],
        source_patterns: list[str],
        target_patterns: list[str],
        model: nn.Module | None = None,
        full_layer_name: str | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        pieces = [input_dict.pop(pattern) for pattern in source_patterns if pattern in input_dict]
        if len(target_patterns) != 1 or not pieces or not pieces[0] or (self.dim is None and len(pieces) != 1):
            raise ValueError(
                f"MergeConcatenate(dim={self.dim}): expected pieces for one target, got "
                f"{len(pieces)} source lists for targets {target_patterns}"
            )
        first = pieces[0][0]
        dim = 1 if self.dim is None else self.dim if self.dim >= 0 else self.dim + first.dim() + 1
        shapes = [[tuple(piece.shape) for piece in group] for group in pieces]  # dim: an axis of (n, ...)
        uniform = all(len(set(group)) == 1 and len(group) == len(pieces[0]) for group in shapes)
        rest = {shape[: dim - 1] + shape[dim:] for group in shapes for shape in group}
        if not (1 <= dim <= first.dim() and uniform and len(rest) == 1):
            raise ValueError(
                f"MergeConcatenate(dim={self.dim}): pieces of shapes "
                f"{[(len(group), group[0]) for group in shapes]} do not stack then concatenate"
            )
        widths = [group[0][dim - 1] for group in shapes]
        shape = (len(pieces[0]), *first.shape[: dim - 1], sum(widths), *first.shape[dim:])
        target = model.get_parameter(full_layer_name) if model is not None and full_layer_name else None
        dtype = (
            target.dtype
            if target is not None
            else functools.reduce(torch.promote_types, (piece.dtype for group in pieces for piece in group))
        )
        packed = torch.empty(shape, dtype=dtype, device=first.device)
        offset = 0
        for group, width in zip(pieces, widths):
            rows = packed.narrow(dim, offset, width)
            for j, piece in enumerate(group):
                rows[j].copy_(piece)
            offset += width
        return {target_patterns[0]: packed}


def one_copy_conversions(load_config: Any, expert_keys: Iterable[str]) -> tuple[Any, dict[int, Any]]:
    """``(config, originals)``: a copy of transformers' ``load_config`` for loading ``expert_keys``
    (the model's expert parameters) with one copy each.

    Its converters that stack then concatenate (``MergeModulelist(dim=0)``, ``Concatenate``: the
    Hub's per-expert ``gate`` and ``up`` keys) or only stack (``down``) do it with
    :class:`MergeConcatenate`, which casts while packing; so that the pieces reach it uncast (views
    of the memory-mapped file, not copies made by the loader's threads), its ``dtype_plan`` reads
    ``expert_keys`` in the checkpoint's dtype, where no entry of the model's plan names them and
    nothing is quantized (:func:`as_local_parameters` casts what no converter did: a packed layout).
    ``originals`` maps the ``id`` of each converter of the copy to the one it replaces (for
    :func:`restore_conversions`)."""
    mapping, originals = [], {}
    for converter in load_config.weight_mapping or ():
        ops = getattr(converter, "operations", ())
        stacks = isinstance(converter, WeightConverter) and ops and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        if stacks and len(ops) >= 2 and type(ops[1]) is Concatenate:
            one_copy = [MergeConcatenate(ops[1].dim), *ops[2:]]
        elif stacks and len(converter.source_patterns) == 1:
            one_copy = [MergeConcatenate(None), *ops[1:]]
        else:
            mapping.append(converter)
            continue
        copied = _with_operations(converter, one_copy)
        originals[id(copied)] = converter
        mapping.append(copied)
    plan = dict(load_config.dtype_plan or {})
    if load_config.hf_quantizer is None:
        planned = build_glob_alternation(list(plan))[0] if plan else None
        plan.update({f"^{re.escape(key)}$": None for key in expert_keys if planned is None or not planned.search(key)})
    return dataclasses.replace(load_config, weight_mapping=mapping, dtype_plan=plan), originals


def _with_operations(converter: Any, operations: list) -> Any:
    """A converter of ``converter``'s class and patterns doing ``operations``: its own ``copy``, which
    keeps its scope and settings, where transformers has one; else (transformers 5.6, whose converters
    hold nothing else) a new one built from its original patterns."""
    patterns = list(converter._original_source_patterns), list(converter._original_target_patterns)
    if hasattr(converter, "copy"):
        return converter.copy(*patterns, operations=operations)
    return type(converter)(*patterns, operations=operations)


def restore_conversions(model: nn.Module, originals: dict[int, Any]) -> None:
    """The conversions transformers' loader kept on ``model`` (reverted when saving) as the model's
    own converters again, not the load's :func:`one_copy_conversions`."""
    used = getattr(model, "_weight_conversions", None)
    if used is not None:
        model._weight_conversions = [originals.get(id(conversion), conversion) for conversion in used]


def load_error(info: Any, expert_keys: dict[str, torch.dtype]) -> str | None:
    """What is wrong with this rank's experts (:func:`as_meta_dtensors`) in the checkpoint, or ``None``."""
    missing = sorted(expert_keys.keys() & set(getattr(info, "missing_keys", ())))
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
        channel.agree(
            channel.next_call(AGREE),
            platform.group_device(group),
            [],
            failed=error is not None,
            caller="epmoe.from_pretrained: the checkpoint does not hold every expert",
            what_failed="found some of their experts missing or with the wrong shape",
        )
    if error is not None:
        raise ValueError(
            f"epmoe.from_pretrained: the checkpoint does not hold every expert: EP rank "
            f"{shards[0].ep_rank if shards else 0}: {error}"
        )


def as_local_parameters(model: nn.Module, expert_keys: dict[str, torch.dtype]) -> None:
    """The loaded ``DTensor`` expert parameters as plain local ``nn.Parameter``s, in their dtypes
    (``expert_keys``, from :func:`as_meta_dtensors`: a packed layout's tensors are read uncast). A
    loader that reads no ``DTensor`` shard (transformers 5.6's sets the whole tensor of all ``E``
    experts in its place, on every rank) leaves a plain tensor: this rank's experts' rows of it."""
    from torch.distributed.tensor import DTensor

    for name, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            param = module.get_parameter(param_name)
            shard = state.shard
            whole = not isinstance(param, DTensor) and param.shape[0] == shard.num_experts > shard.num_local_experts
            if isinstance(param, DTensor) or whole:
                dtype = expert_keys[f"{name}.{param_name}" if name else param_name]
                if whole:  # a copy of this rank's rows: the whole tensor is freed
                    rows = param.detach()[shard.local_start : shard.local_end].to(dtype).clone()
                else:
                    rows = param.to_local().detach().to(dtype)
                local = nn.Parameter(rows, requires_grad=param.requires_grad)
                local._is_hf_initialized = True
                set_parameter(module, param_name, local)
