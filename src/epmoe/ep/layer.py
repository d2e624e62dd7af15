"""The routed path of an EP layer, and the forward that replaces a packed experts module's.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the fused transport, have their forward
replaced by :mod:`epmoe.integrations.blocks`. Every one runs :func:`routed_experts`::

    hidden_TH, top_k_index_TK, top_k_weights_TK      route: from the model's own router
      -> slots per expert, rows per rank  histograms on the device           (epmoe.ep.routing)
      -> exchange_layer_counts            counts exchange: the one host read, the step header riding along
      -> dispatch                         each token once per rank holding its experts (epmoe.ep.dispatcher)
      -> experts                          the local experts' MLP, weighted   (epmoe.ep.mlp)
      -> combine                          back to the sender, summed per token
    out_TH

On a single rank (a group of one, dropless, all-to-all-v, experts that run through grouped matmuls:
:func:`traced_whole`) there is nothing to exchange: the tokens are the rows, the pairs are built on
the device, and the grouped matmuls take their counts there: no host read at all where the backend
takes device offsets, and ``torch.compile`` traces the call whole (no graph break). Every other call
runs :func:`_through_experts` eagerly, behind one graph break per layer (the all-to-all-v splits are
host ints). The grouped matmuls, the routed MLP and the all-to-all-v are custom ops
(``epmoe::grouped_mm``, ``epmoe::routed_mlp``, ``epmoe::all_to_all_v``), opaque to the tracer.

Each forward that exchanges counts is the layer's next *call*; its backward starts with a step-header
exchange (where ``check_steps`` says so), before the layer's backward exchanges (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.comm.steps import FORWARD
from epmoe.ep.dispatcher import SharedMLP, make_dispatcher
from epmoe.ep.guard import check as check_guard
from epmoe.ep.routing import exchange_layer_counts, pair_rows, rows_per_rank, slots_per_expert
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
    if not traced_whole(state, hidden_TH.device):
        return _through_experts(state, hidden_TH, top_k_index_TK, top_k_weights_TK, shared)
    pairs = pair_rows(top_k_index_TK, shard.num_experts)  # on the device: no host read
    state.count_load(pairs.counts_e)
    out_TH = state.experts.routed_mlp(hidden_TH, top_k_weights_TK, pairs)
    return out_TH, None if shared is None else shared.mlp(shared.x_TH)


def traced_whole(state: ExpertParallelState, device: torch.device) -> bool:
    """Whether a call on ``device`` runs on the device alone, which ``torch.compile`` traces whole:
    one with nothing to move (a group of one, dropless, all-to-all-v) whose experts run through
    grouped matmuls only (they take the counts as a tensor). Every other call runs
    :func:`_through_experts`, behind one graph break."""
    return (state.channel is None and state.config.capacity_factor is None and not state.fused_on(device)
            and state.experts.grouped)


@torch.compiler.disable(reason="the counts exchange reads the counts to the host: one graph break per layer")
def _through_experts(state: ExpertParallelState, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor,
                     top_k_weights_TK: torch.Tensor, shared: SharedMLP | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Counts exchange, dispatch, experts, combine, run eagerly under ``torch.compile``."""
    state.calls += 1
    shard, channel, model = state.shard, state.channel, state.model
    guarded = state.layer == 0 and model.guarded
    guard = model.guard_payload(hidden_TH.device) if guarded else None
    rows_W = None if channel is None else rows_per_rank(top_k_index_TK, shard.num_local_experts, channel.size)
    counts = exchange_layer_counts(slots_per_expert(top_k_index_TK, shard.num_experts), rows_W, channel,
                                   state.position(FORWARD), hidden_TH.dtype, guard)
    if guarded:
        check_guard(counts.guards, state.position(FORWARD).describe(channel.layer_names))
    state.count_load(counts.local_counts_e)
    dispatcher = make_dispatcher(state, counts, hidden_TH.device, shared)
    dispatched = dispatcher.dispatch(hidden_TH, top_k_index_TK, top_k_weights_TK)
    out_TH, shared_TH = dispatcher.combine(dispatcher.experts(dispatched))
    return state.backward_header(out_TH), shared_TH


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH, _ = routed_experts(state_of(module), hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
