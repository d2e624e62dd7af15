"""PEFT LoRA as the local experts meet it: wrappers put around their modules after EP was applied.

:mod:`epmoe.ep.lora` settles the LoRA factors of sharded packed experts; this module holds what the
local experts' weights and compute (:mod:`epmoe.ep.expert_weights`, :mod:`epmoe.ep.experts`) do about
the wrappers themselves:

* an ``nn.ModuleList`` expert's Linears wrapped by PEFT (``LoraConfig(target_modules=[...])``) are no
  longer Linears: :func:`rewrapped` tells that an expert's layers were replaced since they were read,
  and the Linear triples are recognised again (then the experts run their own forwards, LoRA included);
* a per-expert post module sits under the LoRA wrapper of its experts module (:func:`post_module`),
  and LoRA on the post module's own weights is refused: its factors span every expert's row, which
  expert parallelism splits.

It imports nothing of the EP record (:mod:`epmoe.ep.lora` does), so the experts can import it.
"""

from __future__ import annotations

from torch import nn

from epmoe.ep.recognize import peft_base


def expert_layers(experts: nn.ModuleList) -> list[tuple[nn.Module, ...]]:
    """Each expert's layers (its child modules, in order), as :func:`rewrapped` compares them."""
    return [tuple(expert.children()) for expert in experts]


def rewrapped(experts: nn.ModuleList, layers: list[tuple[nn.Module, ...]]) -> bool:
    """Whether an expert's layers were replaced since ``layers`` (:func:`expert_layers`) were read,
    e.g. its Linears wrapped by PEFT."""
    return any(a is not b for old, new in zip(layers, expert_layers(experts)) for a, b in zip(old, new))


def post_module(experts: nn.Module, name: str) -> nn.Module:
    """The per-expert post module ``name`` of ``experts`` (of the experts module a LoRA wrapper
    wraps, if it is one); ``ValueError`` if PEFT LoRA adapts the post module's own weights."""
    post = (peft_base(experts) or experts).get_submodule(name)
    if peft_base(post) is not None:
        raise ValueError(
            f"epmoe: {type(experts).__name__}.{name}: PEFT LoRA on the per-expert post module's weights is "
            f"not supported: its factors span every expert's row, which expert parallelism splits. Leave these "
            f"weights out of target_parameters (LoRA on the experts' projections, attention and other Linears "
            f"works)"
        )
    return post
