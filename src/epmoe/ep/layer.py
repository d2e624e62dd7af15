"""The expert-parallel forward that replaces an experts module's own.

    hidden_TH, top_k_index_TK, top_k_weights_TK      (from the model's own router)
      -> plan_routing          sort slots by expert; exchange counts (one host sync)
      -> permute_tokens        rank-major rows
      -> dispatcher.dispatch   all-to-all-v; expert-major rows on the expert's rank
      -> experts_forward       grouped matmuls on the local experts
      -> dispatcher.combine    back to the sender, rank-major
      -> unpermute_and_combine weight by the router, sum each token's K rows
    out_TH
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from epmoe.ep.config import ExpertParallelConfig, ExpertShard
from epmoe.ep.dispatcher import AllToAllDispatcher, permute_tokens, plan_routing, unpermute_and_combine
from epmoe.experts import experts_forward


@dataclass
class ExpertParallelState:
    """What an expert-parallel experts module carries (as ``module._epmoe``)."""

    shard: ExpertShard
    config: ExpertParallelConfig
    group: dist.ProcessGroup | None


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    state: ExpertParallelState = module._epmoe
    shard = state.shard
    shape = hidden_states.shape
    hidden_TH = hidden_states.reshape(-1, shape[-1])
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_TH.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"{shard.module_name}: expected top_k_index and top_k_weights of shape (T, K) with T={hidden_TH.shape[0]}, "
            f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    plan = plan_routing(top_k_index, shard.num_experts, shard.ep_size, state.group)
    dispatcher = AllToAllDispatcher(plan, hidden_TH.device)
    x_rank_major = permute_tokens(hidden_TH, plan, top_k_index.shape[1])
    x_expert_major = dispatcher.dispatch(x_rank_major)
    y_expert_major = experts_forward(module, x_expert_major, plan.local_counts, backend=state.config.gmm_backend)
    y_rank_major = dispatcher.combine(y_expert_major)
    out_TH = unpermute_and_combine(y_rank_major, top_k_weights, plan, hidden_states.dtype)
    return out_TH.view(shape)
