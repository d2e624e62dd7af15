"""Blocks whose shared expert can ride along the fused exchange, and experts the fused ops can run.

With ``dispatch="fused"`` the experts' MLP is split across ``alltoallv_gmm`` / ``gmm_alltoallv``
(:class:`epmoe.ep.exchange.FusedExchange`). A shared expert can fill their communication gaps only
where the block structure is known and its MLP is three bias-free ``nn.Linear`` layers:
Qwen2-MoE / Qwen3.5-MoE / Qwen3-Next blocks (``shared_expert`` and a sigmoid ``shared_expert_gate``)
and DeepSeek blocks (``shared_experts``), whose forward :func:`shared_block_forward` then replaces
(on every exchange: the all-to-all-v one runs the shared expert on its own). Experts the fused ops
cannot express decline with a reason (:func:`fused_ineligible_reason`) and run the all-to-all-v path.
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.exchange import SharedMLP
from epmoe.ep.layer import routed_experts


def fused_ineligible_reason(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot run through ``alltoallv_gmm`` / ``gmm_alltoallv``, or ``None``."""
    if isinstance(experts, nn.ModuleList):
        return "nn.ModuleList experts have no packed weight for the fused ops"
    if experts.has_bias:
        return "the down projection's bias would have to be added between the grouped matmul and the exchange"
    if getattr(experts, "has_post_expert_norm", False):
        return "a post-expert norm would have to run between the grouped matmul and the exchange"
    return None


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
    """Drop-in forward of a Qwen2-MoE-style or DeepSeek-style block: its router, then the routed
    experts with the shared expert handed to the exchange (which overlaps it where it can).

    Runs the block's own forward instead (its experts still expert-parallel) when the experts or the
    shared expert were wrapped after :func:`epmoe.apply_expert_parallel` (e.g. PEFT LoRA): calling
    around a wrapper would drop what it adds.
    """
    state, shared = getattr(block.experts, "_epmoe", None), shared_mlp(block)
    if state is None or shared is None:
        return block._epmoe_block_forward(hidden_states)
    shape = hidden_states.shape
    hidden_TH = hidden_states.reshape(-1, shape[-1])
    _, top_k_weights, top_k_index = block.gate(hidden_TH)
    routed, shared_out = routed_experts(state, hidden_TH, top_k_index, top_k_weights, SharedMLP(shared, hidden_TH))
    if hasattr(block, "shared_expert_gate"):
        shared_out = torch.sigmoid(block.shared_expert_gate(hidden_TH)) * shared_out
    return (routed + shared_out).view(shape)
