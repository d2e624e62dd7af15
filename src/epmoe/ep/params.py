"""Which parameters are expert-parallel: found by identity, and kept out of DDP's hands.

An expert parameter is one that differs per EP rank: the sharded weights and biases of packed
experts, the local ``nn.ModuleList`` experts' parameters, and the LoRA factors PEFT adds on them
after :func:`epmoe.apply_expert_parallel`. The parameters an experts module holds that are not per
expert (a post-expert norm, a scale every expert shares: :func:`~epmoe.ep.recognize.shared_parameters`)
are not: EP leaves them whole on every rank, each rank gets their gradient on its own batch
(:mod:`epmoe.ep.grads`), and DDP broadcasts and averages them like the rest. Every one is marked with its model's
:class:`~epmoe.ep.model.EPModel` (``is_expert_parameter``) when EP shards it, when a structural walk
finds it (:func:`expert_parameters`, DDP's start-up) and at every training forward (the experts'
weights' autograd leaves), so the mark survives wrappers that rename parameters (PEFT's
``base_layer``, FSDP2's FQNs); a copy of the model (``copy.deepcopy``, ``AveragedModel``, TRL's
reference model) has its copies marked with its own ``EPModel`` (:mod:`epmoe.ep.model`), so
``is_expert_parameter`` and ``expert_parameters`` agree on it too.

DDP: :func:`epmoe.apply_expert_parallel` sets the model's ``_ddp_params_and_buffers_to_ignore``
(what ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` sets) to an
:class:`ExpertParameterNames`, which DDP reads once, in its constructor, to exclude those names from
its start-up broadcast and its gradient all-reduce. It names the expert parameters as they are
when DDP is built (so LoRA factors added after EP are included), relative to the model and to a
PeftModel around it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from epmoe.ep.lora import settle_expert_lora
from epmoe.ep.model import EPModel, expert_owner
from epmoe.ep.recognize import peft_base
from epmoe.ep.state import sharded_parameters, state_of

# PeftModel -> LoraModel -> model: how a PeftModel names its base model's parameters
_PEFT_PREFIX = "base_model.model."


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is expert-parallel (held by one EP rank, different on every EP rank)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"is_expert_parameter(param): expected a Tensor, got {type(param).__name__}")
    owner = expert_owner(param)
    return owner is not None and owner.sharded


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every expert-parallel parameter of ``model``, in ``model.parameters()`` order.

    Includes LoRA factors that PEFT added on the experts after EP (narrowed to this rank's experts
    first, see :mod:`epmoe.ep.lora`). Empty for EP size 1 (nothing is sharded: data-parallel wrappers
    treat the experts like any other parameter).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expert_parameters(model): expected an nn.Module, got {type(model).__name__}")
    settle_expert_lora(model)
    found = {id(p): owner for p, owner in _walk(model)}
    params = []
    for p in model.parameters():
        owner = found.get(id(p))
        if owner is not None:
            owner.mark([p])
        if is_expert_parameter(p):
            params.append(p)
    return params


def _walk(model: nn.Module) -> Iterator[tuple[nn.Parameter, EPModel]]:
    """``(parameter, its model's EPModel)`` for every expert parameter reachable by structure."""
    for p, state in sharded_parameters(model):
        yield p, state.model
    for module in model.modules():
        base = peft_base(module)
        if base is not None:  # a PEFT wrapper around an experts module: its own factors are per expert
            base_state = state_of(base)
            if base_state is not None and base_state.model.sharded:
                base_ids = {id(p) for p in base.parameters()}
                for p in module.parameters():
                    if id(p) not in base_ids:
                        yield p, base_state.model


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)``: the parameters of the unsharded model ``model`` stands for (every expert
    counted once, LoRA factors on experts included), as peft's ``get_nb_trainable_parameters`` counts
    a model on one process. No collective: each expert parameter counts ``ep_size`` times its shard."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parameter_counts(model): expected an nn.Module, got {type(model).__name__}")
    experts = {id(p) for p in expert_parameters(model)}
    trainable = total = 0
    for p in model.parameters():
        n = p.numel() * (expert_owner(p).ep_size if id(p) in experts else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


class NumParameters:
    """``model.num_parameters`` of an EP transformers model (an instance attribute; the class is
    untouched): transformers' own count plus the experts the other EP ranks hold, so the count (and
    the ``total_parameters`` of a saved index) is the unsharded model's."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        model = self.model
        local = type(model).num_parameters(model, only_trainable, exclude_embeddings)
        others = 0
        for p, state in sharded_parameters(model):
            if p.requires_grad or not only_trainable:
                others += (state.shard.ep_size - 1) * p.numel()
        return local + others


class ExpertParameterNames:
    """The names DDP must ignore, computed when DDP reads them (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __iter__(self) -> Iterator[str]:
        experts = {id(p) for p in expert_parameters(self.model)}
        for name, param in self.model.named_parameters():
            if id(param) in experts:
                yield name
                yield _PEFT_PREFIX + name

    def __repr__(self) -> str:
        return f"ExpertParameterNames({sorted(set(self))})"
