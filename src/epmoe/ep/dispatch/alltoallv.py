"""The all-to-all-v transport: each token once per rank holding one of its experts.

Each token travels once to each rank holding one of its experts (:mod:`epmoe.ep.routing`'s rows),
its expert ids and routing weights beside it; on the expert's rank the rows expand to their local
experts by index, run ``epmoe::routed_mlp`` (with ``capacity_factor``, each expert's first pairs
only) and come back weighted and summed, one row per (token, rank); the sender sums each token's
rows in rank order. ``W = 2``, ``e = 2`` local experts, token ``t0`` routed to experts 0 and 3::

    rank 0: tokens --gather--> rows (rank, token)     [t0 t1 | t0 t2]  (to rank 0 | to rank 1)
            --all-to-all-v (counts from the counts exchange)--> rows (source, token) on each rank
            --routed MLP: expand to pairs, grouped matmuls, weight, sum per row--> one row per (source, token)
            --all-to-all-v back--> rows (rank, token) [y00 y01 | y10 y12]
            --sum per token in rank order--> out[t0] = y00 + y10

With a group of one the rows are the tokens: nothing moves. Every index is built on the device from
the routing and the exchanged counts. Dropless on a single rank with grouped experts the call runs
on the device alone (:meth:`AllToAllVDispatcher.traced_whole`: the pairs and their counts are built
there, no counts exchange, no host read, traced whole by ``torch.compile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from epmoe.comm import all_to_all_v
from epmoe.ep.config import DROPPED_COUNTER
from epmoe.ep.dispatch.base import Dispatcher, LayerCounts, SharedExpert, exchange_layer_counts
from epmoe.ep.experts import RowSources
from epmoe.ep.routing import (
    GatherRows,
    RowPairs,
    SumRows,
    TokenRows,
    UnpackRoute,
    destinations_TW,
    keep_first,
    pair_rows,
    token_rows,
)
from epmoe.ep.state import ExpertParallelState


@dataclass(frozen=True)
class AllToAllVMeta:
    """One call of :class:`AllToAllVDispatcher`: what :meth:`~AllToAllVDispatcher.experts` and
    :meth:`~AllToAllVDispatcher.combine` read."""

    counts: LayerCounts | None  # the counts exchange's (None: the call ran on the device alone)
    rows: TokenRows | None  # the sender's rows (None on a single rank: the rows are the tokens)
    weights_RK: torch.Tensor  # (R, K) the received rows' routing weights
    pairs: RowPairs  # the pairs the received rows expand to, expert-major


class AllToAllVDispatcher(Dispatcher):
    """All-to-all-v around ``epmoe::routed_mlp`` (see the module docstring). A block's shared expert
    runs in the block."""

    name = "alltoallv"

    def traced_whole(self, state: ExpertParallelState) -> bool:
        """A group of one, dropless, experts that run through grouped matmuls only (which take the
        counts as a tensor)."""
        return state.model.channel is None and state.model.config.capacity_factor is None and state.experts.grouped

    def dispatch(
        self,
        state: ExpertParallelState,
        hidden_TH: torch.Tensor,
        top_k_index_TK: torch.Tensor,
        top_k_weights_TK: torch.Tensor,
        shared: SharedExpert | None = None,
    ) -> tuple[torch.Tensor, AllToAllVMeta]:
        """``(x_RH, meta)``: the rows this rank's local experts run, source-major."""
        shard = state.shard
        if self.traced_whole(state):
            pairs = pair_rows(top_k_index_TK, shard.num_experts)  # on the device: no host read
            state.count_load(pairs.counts_e)
            return hidden_TH, AllToAllVMeta(None, None, top_k_weights_TK, pairs)
        e, K = shard.num_local_experts, top_k_index_TK.shape[1]
        W = 1 if state.model.channel is None else state.model.channel.size
        rows_W = None if W == 1 else destinations_TW(top_k_index_TK, e, W).sum(0)
        counts = exchange_layer_counts(state, hidden_TH, top_k_index_TK, rows_W)
        if W == 1:
            rows, x_RH, weights_RK, local_expert_RK = None, hidden_TH, top_k_weights_TK, top_k_index_TK
        else:
            rows = token_rows(top_k_index_TK, e, W, sum(counts.send_rows_W))
            # each row's K expert ids and weights travel in the row, after its hidden state: one
            # exchange each way (ids exact in the route's float dtype, its bytes carried as they are)
            route_dtype = torch.float64 if top_k_weights_TK.dtype == torch.float64 else torch.float32
            route_TK2 = torch.cat([top_k_index_TK.to(route_dtype), top_k_weights_TK.to(route_dtype)], dim=1)
            sent_RX = GatherRows.apply(hidden_TH, route_TK2, *rows)
            received_RX = all_to_all_v(sent_RX, counts.recv_rows_W, counts.send_rows_W, counts.group)
            x_RH, route_RK2 = UnpackRoute.apply(received_RX, hidden_TH.shape[1], route_dtype)
            local_expert_RK = route_RK2[:, :K].long() - shard.local_start
            local_expert_RK = local_expert_RK.masked_fill((local_expert_RK < 0) | (local_expert_RK >= e), e)
            weights_RK = route_RK2[:, K:].to(top_k_weights_TK.dtype)
        host_counts = counts.local_counts_e
        pairs = pair_rows(local_expert_RK, e, sum(host_counts), host_counts)
        factor = state.model.config.capacity_factor
        if factor is not None:
            pairs, dropped = keep_first(pairs, math.ceil(factor * counts.global_slots / shard.num_experts), host_counts)
            state.count_load(dropped, (DROPPED_COUNTER,))
        return x_RH, AllToAllVMeta(counts, rows, weights_RK, pairs)

    def experts(self, state: ExpertParallelState, x_RH: torch.Tensor, meta: AllToAllVMeta) -> torch.Tensor:
        """``(R, H)``: the local experts on the rows' pairs, weighted and summed per row; with
        ``config.capacity_factor``, only each expert's first ``C`` pairs (the global order: source
        rank, then token, then k), the others' outputs zero and counted as dropped (see
        :class:`~epmoe.ep.config.ExpertParallelConfig`)."""
        sources = None if meta.rows is None else RowSources(meta.counts.recv_rows_W, meta.counts.group)
        return state.experts.routed_mlp(
            x_RH, meta.weights_RK, meta.pairs, sync_weights=state.sync_weights, sources=sources
        )

    def combine(self, state: ExpertParallelState, y_RH: torch.Tensor, meta: AllToAllVMeta) -> torch.Tensor:
        """``(T, H)``: the rows back to their senders, summed per token in rank order; its backward
        checked to start at this layer's position (:meth:`ExpertParallelState.backward_header`)."""
        if meta.rows is None:
            return state.backward_header(y_RH)
        back_RH = all_to_all_v(y_RH, meta.counts.send_rows_W, meta.counts.recv_rows_W, meta.counts.group)
        return state.backward_header(SumRows.apply(back_RH, *meta.rows))
