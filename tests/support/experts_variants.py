"""Experts classes made for the purpose: Qwen3-MoE's ``@use_experts_implementation`` experts with a
forward that does more than the decorated contract (or nothing more), as transformers' new
families do. epmoe must run each exactly or refuse it by name (:mod:`epmoe.ep.contract`); the
families coverage (``test_families.py``) runs them beside the families, at EP 2 and EP 4, as
``qwen3_moe+<variant>``.

=================  ================================================================  ==========
variant            its forward                                                        epmoe
=================  ================================================================  ==========
unchanged          overrides ``forward`` with a call of the decorated one             exact
per_route_norm     each route's output through a learned RMSNorm scale of its         exact
                   expert before the weighted sum (Ergo's)
per_expert_scale   each route's weight times a learned scale of its expert            refused
clamped_output     the weighted sum clamped to [-1, 1]                                refused
bias_after_sum     a learned bias added to the weighted sum                           refused
undecorated        the same experts in a class without the decorator (epmoe adopts    exact
                   them after a probe of its own)
zero_experts       LongCat-Flash's experts as transformers 5.24 (and 5.6) wrote them:     exact
                   ids past the ``E`` experts with weights are zero-computation
                   experts (the token times its weight), in the experts module, not
                   the block
=================  ================================================================  ==========
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

BASE = "qwen3_moe"


class UnchangedExperts(Qwen3MoeExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights)


class PerExpertNorm(nn.Module):
    """A learned RMSNorm scale per expert, applied to rows with their experts' ids."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(num_experts, hidden, generator=generator).to(dtype) + 0.5)

    def forward(self, hidden_states, expert_ids):
        normalized = F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=1e-6)
        return normalized * self.weight[expert_ids]


class PerRouteNormExperts(Qwen3MoeExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        top_k = top_k_index.shape[1]
        rows = hidden_states.repeat_interleave(top_k, dim=0)
        flat = top_k_index.reshape(-1, 1)
        out = super().forward(rows, flat, rows.new_ones(flat.shape))
        out = self.post_expert_norm(out, flat.flatten()).view(*top_k_index.shape, -1)
        return (out * top_k_weights.unsqueeze(-1)).sum(1)


class PerExpertScaleExperts(Qwen3MoeExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights * self.expert_scale[top_k_index])


class ClampedOutputExperts(Qwen3MoeExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights).clamp(-1.0, 1.0)


class BiasAfterSumExperts(Qwen3MoeExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return super().forward(hidden_states, top_k_index, top_k_weights) + self.output_bias


class UndecoratedExperts(nn.Module):
    """Qwen3-MoE's experts without ``@use_experts_implementation``: the same weights, its eager forward."""

    def __init__(self, experts: Qwen3MoeExperts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn

    forward = Qwen3MoeExperts.forward.__wrapped__


class ZeroComputationExperts(nn.Module):
    """LongCat-Flash's experts as transformers 5.24 wrote them (no decorator): ``gate_up_proj`` holds
    ``Z`` more experts than ``down_proj``, whose rows are never read; ids ``[E, E+Z)`` return the token
    times its weight."""

    def __init__(self, experts: nn.Module, zero: int):
        super().__init__()
        self.num_routed_experts = experts.down_proj.shape[0]
        gate_up = experts.gate_up_proj.detach()[: self.num_routed_experts]
        self.gate_up_proj = nn.Parameter(torch.cat([gate_up, gate_up.new_zeros(zero, *gate_up.shape[1:])]))
        self.down_proj, self.act_fn = experts.down_proj, experts.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert_idx in top_k_index.unique().tolist():
            token_idx, top_k_pos = torch.where(top_k_index == expert_idx)
            current = hidden_states[token_idx]
            if expert_idx < self.num_routed_experts:
                gate, up = F.linear(current, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
                current = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            weighted = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, weighted.to(final_hidden_states.dtype))
        return final_hidden_states


def _zero_routed_forward(self, hidden_states):
    """LongCat-Flash's MoE block as transformers 5.24 wrote it: every routing choice to the experts."""
    shape = hidden_states.shape
    hidden_states = hidden_states.reshape(-1, shape[-1])
    _, topk_weights, topk_indices = self.router(hidden_states)
    return self.experts(hidden_states, topk_indices, topk_weights).reshape(shape)


CLASSES = {
    "unchanged": UnchangedExperts,
    "per_route_norm": PerRouteNormExperts,
    "per_expert_scale": PerExpertScaleExperts,
    "clamped_output": ClampedOutputExperts,
    "bias_after_sum": BiasAfterSumExperts,
    "undecorated": UndecoratedExperts,
    "zero_experts": ZeroComputationExperts,
}
BASES = {"zero_experts": "longcat_flash"}  # the family each variant is installed in (default: BASE)
EXPECTED = {
    "unchanged": "exact",
    "per_route_norm": "exact",
    "per_expert_scale": "refused",
    "clamped_output": "refused",
    "bias_after_sum": "refused",
    "undecorated": "exact",
    "zero_experts": "exact",
}


def install(model: nn.Module, variant: str) -> nn.Module:
    """Every Qwen3-MoE experts module of ``model`` as ``variant``'s class, with the parameters its
    forward reads (random, the same for the same model)."""
    generator = torch.Generator().manual_seed(7)
    if variant in ("undecorated", "zero_experts"):
        for block in model.modules():
            experts = getattr(block, "experts", None)
            if variant == "undecorated" and type(experts) is Qwen3MoeExperts:
                block.experts = UndecoratedExperts(experts)
            elif variant == "zero_experts" and type(experts).__name__ == "LongcatFlashExperts":
                if hasattr(block, "zero_expert_num"):  # the block handles them (5.25): its forward as 5.24's
                    zero = block.zero_expert_num
                    block.forward = types.MethodType(_zero_routed_forward, block)
                else:  # the experts handle them already, as 5.24's do (5.6)
                    zero = experts.zero_expert_num
                block.experts = ZeroComputationExperts(experts, zero)
        return model
    for module in model.modules():
        if type(module) is not Qwen3MoeExperts:
            continue
        module.__class__ = CLASSES[variant]
        num, hidden, dtype = module.num_experts, module.hidden_dim, module.down_proj.dtype
        if variant == "per_route_norm":
            module.post_expert_norm = PerExpertNorm(num, hidden, dtype, generator)
        elif variant == "per_expert_scale":
            module.expert_scale = nn.Parameter(torch.rand(num, generator=generator).to(dtype) + 0.5)
        elif variant == "bias_after_sum":
            module.output_bias = nn.Parameter(torch.randn(hidden, generator=generator).to(dtype))
    return model
