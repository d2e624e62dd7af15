"""Reference models (DPO's and GRPO's ``ref_model``, a KL target) that stay expert-parallel.

A reference is the policy's frozen twin: the same forward, its own weights. Made from an EP model it
must hold only this rank's experts, as the policy does, and run the same exchange; made by loading the
checkpoint again without EP (what TRL's ``DPOTrainer`` and ``GRPOTrainer`` do with ``ref_model=None``)
it holds every expert on every rank. :func:`reference_model` makes the first from the policy, with
the weights of an unsharded model where one is given (its experts narrowed to this rank's), and
:func:`epmoe.prepare_trainer` puts it in place of an unsharded ``trainer.ref_model``.

``copy.deepcopy`` of an EP model (TRL's ``create_reference_model``) already is such a twin (its own
:class:`~epmoe.ep.model.EPModel`, only the local experts); this adds freezing and the weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from epmoe.ep.state import ep_states, require_ep_states


def reference_model(model: nn.Module, weights_from: nn.Module | None = None) -> nn.Module:
    """A frozen expert-parallel copy of EP model ``model``: ``copy.deepcopy`` (its own expert
    parallelism over the same group, only this rank's experts), every parameter
    ``requires_grad=False``, no gradients, in eval mode.

    ``weights_from``: an unsharded model of the same architecture (TRL's reference loaded from the
    policy's path); its parameters and buffers are copied in by name, each expert tensor narrowed to
    this rank's experts, so the copy holds only those. Every name and shape must match, or
    ``ValueError`` names the first that does not. Call on every rank of the EP group (the reference's
    forwards exchange tokens like the policy's).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"reference_model(model): expected an nn.Module, got {type(model).__name__}")
    require_ep_states(model, "reference_model(model)")
    if weights_from is not None:
        if not isinstance(weights_from, nn.Module):
            raise TypeError(f"reference_model(weights_from): expected an nn.Module, got {type(weights_from).__name__}")
        if any(True for _ in ep_states(weights_from)):
            raise ValueError(
                "reference_model(weights_from): it is already expert-parallel; use "
                "reference_model(weights_from) itself, or copy.deepcopy(weights_from)"
            )
    reference = copy.deepcopy(model)
    reference.eval()
    for param in reference.parameters():
        param.requires_grad_(False)
        param.grad = None
    if weights_from is not None:
        _copy_weights(reference, weights_from)
    return reference


def _copy_weights(reference: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters and buffers into EP model ``reference`` by name, each expert
    tensor narrowed to ``reference``'s local experts."""
    narrow = {}  # name -> (local start, local experts, experts) of each per-expert tensor
    elsewhere = []  # name prefixes of the experts of a ModuleList that other ranks hold
    for module_name, module, state in ep_states(reference):
        prefix, shard = (f"{module_name}." if module_name else ""), state.shard
        for name in state.sharded_names:
            narrow[prefix + name] = (shard.local_start, shard.num_local_experts, shard.num_experts)
        if not state.experts.weights.packed:  # the record sits on the block; its ModuleList holds the local experts
            held = state.local_experts[0]
            list_name = next(
                n for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and any(e is held for e in m)
            )
            elsewhere += [
                f"{prefix}{list_name}.{i}."
                for i in range(shard.num_experts)
                if not shard.local_start <= i < shard.local_end
            ]
    # every name of a tensor held under several (a norm every expert of a ModuleList shares, tied weights)
    targets = dict(
        [*reference.named_parameters(remove_duplicate=False), *reference.named_buffers(remove_duplicate=False)]
    )
    sources = {
        name: tensor
        for name, tensor in [
            *source.named_parameters(remove_duplicate=False),
            *source.named_buffers(remove_duplicate=False),
        ]
        if not name.startswith(tuple(elsewhere))
    }
    missing, unexpected = sorted(targets.keys() - sources.keys()), sorted(sources.keys() - targets.keys())
    if missing or unexpected:
        raise ValueError(
            f"reference_model(weights_from): not the same architecture: {len(missing)} names it lacks "
            f"{missing[:3]}, {len(unexpected)} the EP model lacks {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, target in targets.items():
            full = sources[name]
            if name in narrow:
                start, local, experts = narrow[name]
                rows = target.shape[0] // local  # rows per expert (flattened experts: several)
                if full.shape[0] != rows * experts or full.shape[1:] != target.shape[1:]:
                    raise ValueError(
                        f"reference_model(weights_from): {name} is {tuple(full.shape)}, expected "
                        f"({rows * experts}, {', '.join(map(str, target.shape[1:]))}) for {experts} experts"
                    )
                full = full.narrow(0, start * rows, target.shape[0])
            elif full.shape != target.shape:
                raise ValueError(
                    f"reference_model(weights_from): {name} is {tuple(full.shape)}, the EP model's "
                    f"{tuple(target.shape)}"
                )
            target.copy_(full)
