"""Model blocks around experts: their routers, shared experts, and the forwards epmoe puts in place.

* A block holding an ``nn.ModuleList`` of experts (transformers 4.x style, custom models), whose loop
  over experts cannot be intercepted at the list: :func:`expert_parallel_block_forward` replaces its
  forward. It calls the block's own router; a router that returns only logits gets the classic
  routing ``softmax (fp32) -> top-k -> renormalise unless block.norm_topk_prob is False -> cast``
  (router jitter noise in training is refused: it cannot be reproduced), one returning
  ``(logits, weights, index)`` is used as is. Shared experts (``shared_expert`` with an optional
  sigmoid ``shared_expert_gate``, or ``shared_experts``) are added as in Qwen2-MoE / DeepSeek.
* A block whose shared expert can ride along the fused transport: where a layer's transport is
  ``"fused"`` (``dispatch="fused"``, decided when EP is applied) the experts' MLP is split across
  ``alltoallv_gmm`` / ``gmm_alltoallv`` (:class:`epmoe.ep.dispatch.fused.FusedDispatcher`), and a
  shared expert can fill their communication gaps where the block's forward is known and its MLP is
  three bias-free ``nn.Linear`` layers: Qwen2-MoE / Qwen3.5-MoE / Qwen3-Next blocks
  (``shared_expert`` and a sigmoid ``shared_expert_gate``) and DeepSeek blocks (``shared_experts``).
  :func:`shared_block_forward` then replaces their forward; on every other transport the block keeps
  its own.

Both hand the routed experts to :func:`epmoe.ep.layer.routed_experts`.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from epmoe.ep.dispatch import SharedExpert
from epmoe.ep.layer import routed_experts
from epmoe.ep.state import ExpertParallelState, state_of


def block_router(block: nn.Module) -> nn.Module:
    """The router of a block holding experts: its ``gate`` or ``router`` submodule."""
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        if isinstance(router, nn.Module):
            return router
    raise ValueError(f"{type(block).__name__}: a block with experts needs a `gate` or `router` module")


def block_top_k(block: nn.Module) -> int:
    for name in ("top_k", "num_experts_per_tok"):
        value = getattr(block, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(block).__name__}: a block with ModuleList experts needs `top_k` or `num_experts_per_tok`")


def route(block: nn.Module, hidden_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits [T,E], top_k_weights [T,K], top_k_index [T,K])`` from the block's own router."""
    if block.training and getattr(block, "jitter_noise", 0):
        raise ValueError(f"{type(block).__name__}: router jitter noise in training is not supported under EP")
    routed = block_router(block)(hidden_TH)
    if isinstance(routed, tuple):
        logits, weights, index = routed[:3]
        return logits, weights, index
    probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, block_top_k(block), dim=-1)
    if getattr(block, "norm_topk_prob", True):  # 4.x Mixtral has no flag and always renormalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return routed, weights.to(hidden_TH.dtype), index


def shared_experts_output(block: nn.Module, hidden_TH: torch.Tensor) -> torch.Tensor | None:
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if shared is None:
        return None
    out = shared(hidden_TH)
    gate = getattr(block, "shared_expert_gate", None)
    return out if gate is None else torch.sigmoid(gate(hidden_TH)) * out


def expert_parallel_block_forward(block: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """Drop-in for the forward of a block with ``nn.ModuleList`` experts (see the module docstring)."""
    state: ExpertParallelState = state_of(block)
    shape = hidden_states.shape
    hidden_TH = hidden_states.reshape(-1, shape[-1])
    logits, weights, index = route(block, hidden_TH)
    out_TH = routed_experts(state, hidden_TH, index, weights)
    shared = shared_experts_output(block, hidden_TH)
    if shared is not None:
        out_TH = out_TH + shared
    out = out_TH.view(shape)
    return (out, logits) if state.returns_router_logits else out


# The transformers blocks whose forward shared_block_forward reproduces exactly (read from
# transformers 5.24): (module, class). A block qualifies only if its class's forward *is* one of
# theirs, so a subclass that changes the forward keeps its own.
SHARED_EXPERT_BLOCKS = (
    ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    ("qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
    ("qwen3_next.modeling_qwen3_next", "Qwen3NextSparseMoeBlock"),
    ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE"),
)


@functools.cache
def _shared_expert_forwards() -> frozenset:
    forwards = set()
    for module, name in SHARED_EXPERT_BLOCKS:
        try:
            forwards.add(getattr(importlib.import_module(f"transformers.models.{module}"), name).forward)
        except (ImportError, AttributeError):  # not in the installed transformers
            continue
    return frozenset(forwards)


def is_shared_expert_block(block: nn.Module, experts: nn.Module) -> bool:
    """A known block around ``experts`` whose shared expert can ride along the fused ops (its forward
    the class's own: none set on the instance)."""
    return (
        type(block).forward in _shared_expert_forwards()
        and "forward" not in vars(block)
        and getattr(block, "experts", None) is experts
        and shared_mlp(block) is not None
    )


def shared_mlp(block: nn.Module) -> nn.Module | None:
    """The block's shared expert if it is ``down(act(gate(x)) * up(x))`` of bias-free Linears."""
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    layers = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if mlp is None or not hasattr(mlp, "act_fn"):
        return None
    if not all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers):
        return None
    return mlp


def shared_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Drop-in forward of a Qwen2-MoE-style or DeepSeek-style block whose experts take the fused
    transport: its router, then the routed experts with the shared expert (and its gate) handed to
    the transport to overlap.

    Runs the block's class forward instead (its experts still expert-parallel, through their own
    module call and its hooks) when the experts or the shared expert were wrapped after
    :func:`epmoe.apply_expert_parallel` (e.g. PEFT LoRA): calling around a wrapper would drop what it
    adds.
    """
    state, shared = state_of(block.experts), shared_mlp(block)
    if state is None or shared is None:
        return type(block).forward(block, hidden_states)
    shape = hidden_states.shape
    hidden_TH = hidden_states.reshape(-1, shape[-1])
    _, top_k_weights, top_k_index = block.gate(hidden_TH)
    shared_expert = SharedExpert(shared, getattr(block, "shared_expert_gate", None))
    return routed_experts(state, hidden_TH, top_k_index, top_k_weights, shared_expert).view(shape)
