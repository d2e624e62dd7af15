"""A layer call's rows under a replica plan, for the exchanges that serve one: sent, and read on arrival.

Under a plan (:mod:`epmoe.ep.replicas`) each token's rows travel as without one, and each slot the
plan moves off this rank travels as a row of its own to its helper
(:func:`~epmoe.ep.routing.redirected_slots`), merged into them destination-major
(:func:`~epmoe.ep.routing.replica_rows`). Every row carries its choices' ids, in one numbering
(:class:`~epmoe.ep.routing.RouteIds`), and its token's routing weights, after its hidden state in the
route dtype (:func:`~epmoe.ep.routing.route_dtype`); the receiver reads off the ids the pairs of its
own experts and of the experts lent to it. The per-rank exchange (:mod:`~epmoe.ep.dispatch.alltoallv`)
and the two-level one (:mod:`~epmoe.ep.dispatch.nodes`) differ only in their splits and hops::

    sender    send_with_replicas: each token's rows, then each moved slot's row at its helper's
              destination (its rank; the two-level exchange's: its node), one packed row each
    hops      the transport's: one all-to-all-v; or between nodes, then inside one, the forwarder
              routing each row by its ids (RouteIds.rank_RK)
    receiver  arrived_with_replicas: the rows' hidden states and weights, the pairs of the local
              experts and of the lent experts (RouteIds.local)
"""

from __future__ import annotations

import torch

from epmoe.ep.dispatch.base import Arrived, Link, RoutedRows
from epmoe.ep.routing import (
    GatherRows,
    RouteIds,
    RowSources,
    TokenRows,
    UnpackRoute,
    pair_rows,
    redirected_slots,
    replica_rows,
    route_dtype,
    token_rows,
)


def send_with_replicas(
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    link: Link,
    send_rows_D: list[int],
    ranks_per_destination: int,
    num_redirected: int,
) -> tuple[torch.Tensor, TokenRows]:
    """``(sent_RX, rows)``: the rows this rank sends under ``link.plan``, destination-major
    (:func:`~epmoe.ep.routing.replica_rows`: ``send_rows_D[d]`` token rows to destination ``d``, of
    ``ranks_per_destination`` consecutive ranks, then the ``num_redirected`` moved slots' rows to
    it), ``sent_RX`` ``(R, H + C)`` in the hidden dtype: each row's hidden state, then its ``K`` ids
    and its token's ``K`` weights in the route dtype (``C`` columns' worth)."""
    shard = link.shard
    e, K, H = shard.num_local_experts, top_k_index_TK.shape[1], hidden_TH.shape[1]
    redirected = redirected_slots(top_k_index_TK, link.plan.moves_from(shard.ep_rank), shard.ep_size, num_redirected)
    rows = token_rows(top_k_index_TK, ranks_per_destination * e, len(send_rows_D), sum(send_rows_D))
    dest_X = redirected[2] // ranks_per_destination
    rows, ids_RK = replica_rows(top_k_index_TK, rows, send_rows_D, redirected, dest_X, RouteIds(e, shard.num_experts))
    dtype = route_dtype(hidden_TH.dtype, top_k_weights_TK.dtype)
    weights_TK = top_k_weights_TK.to(dtype)
    sent_RX = GatherRows.apply(hidden_TH, torch.cat([torch.zeros_like(weights_TK), weights_TK], dim=1), *rows)
    ids_columns = K * dtype.itemsize // hidden_TH.dtype.itemsize  # whole columns: route_dtype
    sent_RX[:, H : H + ids_columns] = ids_RK.to(dtype).view(hidden_TH.dtype)  # each row's own ids
    return sent_RX, rows


def arrived_with_replicas(
    received_RX: torch.Tensor, hidden: int, weights_dtype: torch.dtype, link: Link, sources: RowSources | None
) -> tuple[torch.Tensor, Arrived]:
    """``(x_RH, arrived)``: the rows ``received_RX`` (packed by :func:`send_with_replicas`, ``hidden``
    columns of hidden state each; from ``sources``, where the transport keeps them) unpacked, their
    weights back in ``weights_dtype``, and what the local experts run on them: the pairs of this
    rank's own experts and of the experts lent to it (their slots from the plan,
    :meth:`~epmoe.ep.replicas.ReplicaPlan.local_counts`)."""
    shard, counts = link.shard, link.counts
    e, rank = shard.num_local_experts, shard.ep_rank
    x_RH, route_RK2 = UnpackRoute.apply(received_RX, hidden, route_dtype(received_RX.dtype, weights_dtype))
    K = route_RK2.shape[1] // 2
    computed = link.plan.local_counts(rank)  # the local experts' slots, then the lent experts'
    own, lent = computed[:e], computed[e:]
    own_RK, lent_RK = RouteIds(e, shard.num_experts).local(route_RK2[:, :K].long(), rank, len(lent))
    routed = RoutedRows(
        route_RK2[:, K:].to(weights_dtype),
        pair_rows(own_RK, e, sum(own), own),
        sources,
        pair_rows(lent_RK, len(lent), sum(lent), lent),
    )
    return x_RH, Arrived(routed, counts.local_counts_e, None, counts.peer_guards)
