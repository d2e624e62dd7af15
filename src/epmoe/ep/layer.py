"""The routed path of an EP layer, and the forward that replaces a packed experts module's.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the fused transport, have their forward
replaced by :mod:`epmoe.integrations.blocks`. Every one runs :func:`routed_experts`::

    hidden_TH, top_k_index_TK, top_k_weights_TK      route: from the model's own router
      -> sort_slots, permute_tokens     rank-major rows, sorted by expert on the device (epmoe.ep.routing)
      -> exchange_layer_counts          counts exchange: one host read, the step header riding along
      -> dispatch                       to the experts' ranks, expert-major   (epmoe.ep.dispatcher)
      -> experts                        the local experts' MLP                (epmoe.ep.experts)
      -> combine                        back to the sender, rank-major
      -> unpermute_and_combine          weight by the router, sum each token's K rows
    out_TH

Under ``torch.compile`` everything but counts exchange, dispatch, experts and combine is traced;
those run eagerly in :func:`_through_experts`, behind one graph break per layer (the all-to-all-v
splits are host ints). A call with nothing to move (:func:`traced_whole`: a group of one) runs its
experts on counts copied to the host inside the graph: no graph break. The grouped matmuls and the
all-to-all-v are custom ops (``epmoe::grouped_mm``, ``epmoe::all_to_all_v``), opaque to the tracer.

Each forward that exchanges counts is the layer's next *call*; its backward starts with a step-header
exchange (where ``check_steps`` says so), before the layer's backward exchanges (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.comm.steps import FORWARD
from epmoe.ep.dispatcher import SharedMLP, make_dispatcher
from epmoe.ep.guard import check as check_guard
from epmoe.ep.routing import SlotOrder, exchange_layer_counts, permute_tokens, sort_slots, unpermute_and_combine
from epmoe.ep.state import ExpertParallelState, state_of


def routed_experts(
    state: ExpertParallelState, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor, shared: SharedMLP | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(routed_TH, shared_TH or None)``: every token's routed experts' outputs, weighted and summed,
    and the shared expert's output where one is given (overlapped with the transport where it can be)."""
    shard = state.shard
    if (top_k_index_TK.dim() != 2 or top_k_index_TK.shape[0] != hidden_TH.shape[0]
            or top_k_weights_TK.shape != top_k_index_TK.shape):
        raise ValueError(
            f"{shard.module_name}: expected top_k_index and top_k_weights of shape (T, K) with T={hidden_TH.shape[0]}, "
            f"got {tuple(top_k_index_TK.shape)} and {tuple(top_k_weights_TK.shape)}"
        )
    state.refuse_meta(hidden_TH)
    slots = sort_slots(top_k_index_TK, shard.num_experts)
    x_rank_major = permute_tokens(hidden_TH, slots, top_k_index_TK.shape[1])
    if traced_whole(state, hidden_TH.device):
        counts_E = slots.tokens_per_expert_E.cpu()  # the one host read: a copy, which torch.compile traces
        state.count_load(counts_E)
        y_rank_major = state.experts.forward(x_rank_major, counts_E)
        shared_TH = None if shared is None else shared.mlp(shared.x_TH)
    else:
        y_rank_major, shared_TH = _through_experts(state, slots, x_rank_major, shared)
    return unpermute_and_combine(y_rank_major, top_k_weights_TK, slots, hidden_TH.dtype), shared_TH


def traced_whole(state: ExpertParallelState, device: torch.device) -> bool:
    """Whether ``torch.compile`` traces a call on ``device`` whole: one with nothing to move (a
    group of one, dropless, all-to-all-v) whose experts run through grouped matmuls only (they take
    the counts as a tensor). Every other call runs :func:`_through_experts`, behind one graph break."""
    return (state.channel is None and state.config.capacity_factor is None and not state.fused_on(device)
            and state.experts.grouped)


@torch.compiler.disable(reason="the counts exchange reads the counts to the host: one graph break per layer")
def _through_experts(state: ExpertParallelState, slots: SlotOrder, x_rank_major: torch.Tensor,
                     shared: SharedMLP | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Counts exchange, dispatch, experts, combine: the rank-major rows to their experts and back,
    run eagerly under ``torch.compile``."""
    state.calls += 1
    sync = state.sync
    guarded = state.layer == 0 and sync is not None and sync.guarded
    guard = sync.guard.payload(sync.root, x_rank_major.device) if guarded else None
    counts = exchange_layer_counts(slots, state.channel, state.position(FORWARD), x_rank_major.dtype, guard)
    if guarded:
        check_guard(counts.guards, state.position(FORWARD).describe(state.channel.layer_names))
    state.count_load(counts.local_counts_e)
    dispatcher = make_dispatcher(state, counts, x_rank_major.device, shared)
    x_expert_major = dispatcher.dispatch(x_rank_major)
    y_expert_major = dispatcher.experts(x_expert_major)
    y_rank_major, shared_TH = dispatcher.combine(y_expert_major)
    return state.backward_header(y_rank_major), shared_TH


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH, _ = routed_experts(state_of(module), hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
