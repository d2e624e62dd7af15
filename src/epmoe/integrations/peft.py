"""PEFT LoRA on expert-parallel experts: which wrappers hold per-expert factors, and their layouts.

peft's ``target_parameters`` LoRA on a packed experts tensor of ``e`` local experts keeps, per
adapter, ``lora_A`` ``(r*e, in)`` (expert-major: expert ``j``'s rows are ``[j*r, (j+1)*r)``) and
``lora_B`` ``(out, r*e)`` (expert-minor: viewed ``(out, r, e)``, expert ``j`` is ``[:, :, j]``)::

    lora_A (r*e, in)    rank 0 rows | rank 1 rows          all E: cat along dim 0
    lora_B (out, r*e)   --view--> (out, r, e)              all E: cat along dim 2, then (out, r*E)

Checkpoints (:mod:`epmoe.checkpoint.dcp`, :mod:`epmoe.checkpoint.save`) and training read these
layouts here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from epmoe.ep.lora import settle_expert_lora
from epmoe.ep.recognize import peft_base
from epmoe.ep.state import ExpertParallelState, state_of

FACTORS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class FactorLayout:
    """Where the experts are in one LoRA factor: ``dim`` of the factor viewed as ``view`` (``None``:
    as it is)."""

    dim: int
    view: tuple[int, ...] | None = None


def expert_lora_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertParallelState]]:
    """``(name, wrapper, state)`` of every PEFT LoRA wrapper whose base is an EP experts module (its
    factors are per local expert), in ``named_modules()`` order; each holds this rank's experts'
    factors only (:func:`epmoe.ep.lora.settle_expert_lora` runs first)."""
    settle_expert_lora(model)
    for name, module in model.named_modules():
        state = state_of(peft_base(module))
        if state is not None:
            yield name, module, state


def has_expert_lora(model: nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA factors on expert-parallel experts."""
    return any(True for _ in expert_lora_wrappers(model))


def adapter_without_experts(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model whose adapter holds nothing of its expert-parallel experts: no
    LoRA factor on them and no copy of them kept to save (peft's ``modules_to_save``), so that peft's
    adapter save, which takes the whole ``state_dict()`` and keeps the adapter's keys, writes none."""
    if getattr(model, "peft_config", None) is None or has_expert_lora(model):
        return False
    kept = (m for m in model.modules() if type(m).__name__ == "ModulesToSaveWrapper")
    return not any(state_of(inner) is not None for wrapper in kept for inner in wrapper.modules())


def factor_weights(wrapper: nn.Module) -> Iterator[tuple[str, str, nn.Linear]]:
    """``(factor, adapter, linear)`` of every LoRA factor of ``wrapper``."""
    for factor in FACTORS:
        for adapter, linear in getattr(wrapper, factor).items():
            yield factor, adapter, linear


def factor_layout(factor: str, linear: nn.Linear, num_local_experts: int) -> FactorLayout:
    """The experts' dim of ``factor`` (``"lora_A"`` or ``"lora_B"``; see the module docstring)."""
    if factor == "lora_A":
        return FactorLayout(0)
    return FactorLayout(2, (linear.weight.shape[0], -1, num_local_experts))


def cat_factor(factor: str, parts: list[torch.Tensor], num_local_experts: int) -> torch.Tensor:
    """Every rank's ``num_local_experts`` experts of one LoRA factor (``parts``, in rank order) as the
    factor of all experts, in global expert order."""
    if factor == "lora_A":  # (r*e, in), expert-major: row blocks
        return torch.cat(parts)
    out_features = parts[0].shape[0]  # (out, r*e), expert-minor: viewed (out, r, e)
    blocks = [p.view(out_features, -1, num_local_experts) for p in parts]
    return torch.cat(blocks, dim=2).reshape(out_features, -1)
