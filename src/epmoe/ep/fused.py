"""The engine's fused path: ``dispatch="fused"``, the experts MLP split across the two fused ops.

    x_rank_major --alltoallv_gmm(gate_up_proj)--> h_expert_major   (shared: x @ [gate; up] of the
                                                                    shared expert, round 0 in flight)
    h_expert_major -> the experts' own gate / activation
    h_expert_major --gmm_alltoallv(down_proj)--> y_rank_major       (shared: h_s @ down, hiding the
                                                                    last round)

The shared expert rides along only where the block structure is known and its MLP is three bias-free
``nn.Linear`` layers: Qwen2-MoE / Qwen3.5-MoE / Qwen3-Next blocks (``shared_expert`` and a sigmoid
``shared_expert_gate``) and DeepSeek blocks (``shared_experts``), whose forward
:func:`shared_block_forward` then replaces. Experts the fused ops cannot express decline with a reason
(:func:`fused_ineligible_reason`) and run the all-to-all-v path.
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv
from epmoe.comm.steps import FORWARD
from epmoe.ep.dispatcher import permute_tokens, plan_routing, unpermute_and_combine
from epmoe.experts import gate_activation, packed_weight_names


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


def fused_routed_experts(
    state, hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    shared: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(routed_TH, shared_TH or None)``: the routed experts through the fused ops, and the shared
    expert MLP computed inside their communication gaps."""
    shard, experts, config = state.shard, state.local_experts, state.config
    plan = plan_routing(top_k_index, shard.num_experts, state.channel, state.position(FORWARD))
    state.count_load(plan.local_counts)
    x_rank_major = permute_tokens(hidden_TH, plan, top_k_index.shape[1])
    trans_weight = not experts.is_transposed
    up_proj, down_proj = state.sync_weights([getattr(experts, name) for name in packed_weight_names(experts)])
    options = dict(num_chunks=config.num_chunks, gmm_backend=config.gmm_backend, check=False)  # counts exchanged above

    shared_up = {}
    if shared is not None:
        gate_up_weight = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])  # (2Is, H), Linear layout
        shared_up = dict(shared_x=hidden_TH, shared_weight=gate_up_weight, trans_shared_weight=True)
    h_expert_major, shared_gate_up, _ = alltoallv_gmm(
        x_rank_major, up_proj, plan.send_counts, plan.recv_counts, plan.group,
        trans_weight=trans_weight, **shared_up, **options,
    )
    h_expert_major = gate_activation(experts, h_expert_major)

    shared_down = {}
    if shared is not None:
        gate, up = shared_gate_up.chunk(2, dim=-1)
        shared_down = dict(shared_x=shared.act_fn(gate) * up, shared_weight=shared.down_proj.weight,
                           trans_shared_weight=True)
    y_rank_major, shared_out = gmm_alltoallv(
        h_expert_major, down_proj, plan.recv_counts, plan.send_counts, plan.group,
        trans_weight=trans_weight, **shared_down, **options,
    )
    y_rank_major = state.backward_header(y_rank_major)
    return unpermute_and_combine(y_rank_major, top_k_weights, plan, hidden_TH.dtype), shared_out


def shared_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Drop-in forward of a Qwen2-MoE-style or DeepSeek-style block, shared expert overlapped.

    Runs the block's own forward instead (its experts still expert-parallel, without the shared
    expert in their gaps) when this call does not take the fused path, or when the experts or the
    shared expert were wrapped after :func:`epmoe.apply_expert_parallel` (e.g. PEFT LoRA): calling
    around a wrapper would drop what it adds.
    """
    state, shared = getattr(block.experts, "_epmoe", None), shared_mlp(block)
    if state is None or shared is None or state.dispatch_on(hidden_states.device) != "fused":
        return block._epmoe_block_forward(hidden_states)
    shape = hidden_states.shape
    hidden_TH = hidden_states.reshape(-1, shape[-1])
    state.begin_forward(hidden_TH)
    _, top_k_weights, top_k_index = block.gate(hidden_TH)
    routed, shared_out = fused_routed_experts(state, hidden_TH, top_k_index, top_k_weights, shared)
    if hasattr(block, "shared_expert_gate"):
        shared_out = torch.sigmoid(block.shared_expert_gate(hidden_TH)) * shared_out
    return (routed + shared_out).view(shape)
