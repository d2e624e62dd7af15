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
the routing and the exchanged counts (:mod:`epmoe.ep.counts`, run by the layer first). Dropless on a
single rank with grouped experts the call runs on the device alone (``on_device``: the pairs and
their counts are built there, no counts exchange, no host read, traced whole by ``torch.compile``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm import all_to_all_v
from epmoe.ep.counts import LayerCounts
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, RoutedRows
from epmoe.ep.dispatch.replica_rows import arrived_with_replicas, send_with_replicas
from epmoe.ep.replicas import ReplicaPlan
from epmoe.ep.routing import (
    GatherRows,
    RowSources,
    SumRows,
    TokenRows,
    UnpackRoute,
    keep_first,
    pair_rows,
    route_dtype,
    token_rows,
)


@dataclass(frozen=True)
class AllToAllVMeta:
    """One call of :class:`AllToAllVDispatcher`: what :meth:`~AllToAllVDispatcher.combine` reads."""

    arrived: Arrived
    counts: LayerCounts | None  # the counts exchange's (None: the call ran on the device alone)
    rows: TokenRows | None  # the sender's rows (None on a single rank: the rows are the tokens)
    splits: tuple[list[int], list[int]] | None = None  # (send_W, recv_W) with expert replicas, else the counts'


class AllToAllVDispatcher(Dispatcher):
    """All-to-all-v around the routed MLP (see the module docstring); ``on_device``: the call runs on
    the device alone (a group of one, dropless, experts that run through grouped matmuls only, which
    take the counts as a tensor), decided when EP is applied. A block's shared expert runs in the block."""

    name = "alltoallv"

    def __init__(self, *, on_device: bool = False):
        self.on_device = on_device
        self.needs_counts = not on_device

    def traced_whole(self, checks: bool) -> bool:
        return self.on_device

    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, AllToAllVMeta]:
        """``(x_RH, meta)``: the rows this rank's local experts run, source-major."""
        shard, counts = link.shard, link.counts
        if link.plan is not None:
            return self._with_replicas(hidden_TH, top_k_index_TK, top_k_weights_TK, link)
        if counts is None:  # on the device alone: the tokens are the rows, no host read
            pairs = pair_rows(top_k_index_TK, shard.num_experts)
            return hidden_TH, AllToAllVMeta(Arrived(RoutedRows(top_k_weights_TK, pairs), pairs.counts_e), None, None)
        e, K = shard.num_local_experts, top_k_index_TK.shape[1]
        if link.channel is None:
            rows, x_RH, weights_RK, local_expert_RK, sources = None, hidden_TH, top_k_weights_TK, top_k_index_TK, None
        else:
            rows = token_rows(top_k_index_TK, e, link.channel.size, sum(counts.send_rows_W))
            # each row's K expert ids and weights travel in the row, after its hidden state: one
            # exchange each way (exact in the route dtype, its bytes carried as they are)
            dtype = route_dtype(hidden_TH.dtype, top_k_weights_TK.dtype)
            route_TK2 = torch.cat([top_k_index_TK.to(dtype), top_k_weights_TK.to(dtype)], dim=1)
            sent_RX = GatherRows.apply(hidden_TH, route_TK2, *rows)
            received_RX = all_to_all_v(sent_RX, counts.recv_rows_W, counts.send_rows_W, counts.group)
            x_RH, route_RK2 = UnpackRoute.apply(received_RX, hidden_TH.shape[1], dtype)
            local_expert_RK = route_RK2[:, :K].long() - shard.local_start
            local_expert_RK = local_expert_RK.masked_fill((local_expert_RK < 0) | (local_expert_RK >= e), e)
            weights_RK = route_RK2[:, K:].to(top_k_weights_TK.dtype)
            sources = RowSources(counts.recv_rows_W, counts.group)
        host_counts = counts.local_counts_e
        pairs, dropped = pair_rows(local_expert_RK, e, sum(host_counts), host_counts), None
        if link.capacity is not None:  # each expert's first pairs in the global order (source, token, k)
            pairs, dropped = keep_first(pairs, link.capacity, host_counts)
        arrived = Arrived(RoutedRows(weights_RK, pairs, sources), host_counts, dropped, counts.peer_guards)
        return x_RH, AllToAllVMeta(arrived, counts, rows)

    def _with_replicas(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, AllToAllVMeta]:
        """:meth:`dispatch` under a replica plan (:mod:`epmoe.ep.replicas`): the rows of
        :mod:`~epmoe.ep.dispatch.replica_rows` (a row of its own per slot moved to a helper), in one
        all-to-all-v whose splits follow from the counts exchange and the plan (:func:`_replica_splits`)."""
        counts = link.counts
        send_W, recv_W = _replica_splits(counts, link.plan, link.shard.ep_rank)
        num_redirected = sum(send_W) - sum(counts.send_rows_W)
        sent_RX, rows = send_with_replicas(
            hidden_TH, top_k_index_TK, top_k_weights_TK, link, counts.send_rows_W, 1, num_redirected
        )
        received_RX = all_to_all_v(sent_RX, recv_W, send_W, counts.group)
        sources = RowSources(recv_W, counts.group)
        x_RH, arrived = arrived_with_replicas(received_RX, hidden_TH.shape[1], top_k_weights_TK.dtype, link, sources)
        return x_RH, AllToAllVMeta(arrived, counts, rows, (send_W, recv_W))

    def combine(self, y_RH: torch.Tensor, meta: AllToAllVMeta) -> torch.Tensor:
        """``(T, H)``: the rows back to their senders, summed per token in rank order."""
        if meta.rows is None:
            return y_RH
        send_W, recv_W = meta.splits or (meta.counts.send_rows_W, meta.counts.recv_rows_W)
        back_RH = all_to_all_v(y_RH, send_W, recv_W, meta.counts.group)
        return SumRows.apply(back_RH, *meta.rows)


def _replica_splits(counts: LayerCounts, plan: ReplicaPlan, rank: int) -> tuple[list[int], list[int]]:
    """``(send_W, recv_W)``: the rows ``rank`` sends each rank and receives from each, the counts
    exchange's and a row of its own per moved slot: its own redirected slots
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.redirected_rows_W`) and those it helps with
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.rows_into`), no loop over every source's moves."""
    send_W = [a + b for a, b in zip(counts.send_rows_W, plan.redirected_rows_W(rank))]
    recv_W = list(counts.recv_rows_W)
    for source, rows in plan.rows_into(rank):
        recv_W[source] += rows
    return send_W, recv_W
