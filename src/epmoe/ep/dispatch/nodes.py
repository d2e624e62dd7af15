"""The two-level exchange: each token crosses to each node holding one of its experts once, then fans out inside it.

Over ``N`` nodes of ``P`` EP ranks (:mod:`epmoe.ep.topology`), a token goes first to each node
holding one of its experts, to the rank there at the sender's own local index (its *rail peer*: the
rail groups are the ranks of one local index, one per node), once per node however many of its
experts the node holds; that rank then forwards it inside the node to each rank holding one of its
experts. The combine mirrors it: each forwarder sums the outputs its node's ranks sent back for a
row (in rank order), one row per node goes back, and the sender sums its nodes' rows::

    sender (node 0, local 1), token t -> experts on ranks 2 and 3 (node 1) and 0 (node 0)
      hop 1 (rail group, by node): t once to rank 1 (itself, node 0) and once to rank 3 (node 1)
      hop 2 (node groups): rank 1 forwards t to rank 0; rank 3 forwards t to ranks 2 and 3
      experts: the routed MLP on each rank's rows
      back, hop 2: ranks 2, 3 -> rank 3 sums them into one row; rank 0 -> rank 1
      back, hop 1: rank 3 -> rank 1 (one row from node 1); rank 1 sums its nodes' rows: out[t]

The rows cross between nodes once per (token, node) where the per-rank exchange sends them once per
(token, rank). Every count comes from the layer's one counts exchange (its :class:`~epmoe.ep.counts.NodeSplits`:
each sender tells its rail peers what it sends each node and what they forward to each rank there),
so the call reads the host once, as the per-rank exchange does. The route (each row's K expert ids
and weights) rides in the row through both hops, as in :mod:`epmoe.ep.dispatch.alltoallv`; a
forwarder sends each row on to the ranks its ids say (:class:`~epmoe.ep.routing.RouteIds`, which
under a replica plan also name a moved slot's helper: :mod:`~epmoe.ep.dispatch.replica_rows`),
gathering the packed rows as they arrived. Every gather's backward is a fixed-order sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm import all_to_all_v
from epmoe.comm.steps import step_subgroups
from epmoe.ep.config import ExpertShard
from epmoe.ep.counts import NodeSplits
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, RoutedRows
from epmoe.ep.dispatch.replica_rows import arrived_with_replicas, send_with_replicas
from epmoe.ep.replicas import ReplicaPlan
from epmoe.ep.routing import GatherRows, RouteIds, SumRows, TokenRows, UnpackRoute, pair_rows, route_dtype, token_rows
from epmoe.ep.topology import NodeLayout


class NodeGroups:
    """The process groups of one EP rank's two hops: its ``rail`` (its local index on every node, by
    node) and its ``node`` (its node's ranks); shared by a deep copy of the model (one group per set
    of ranks)."""

    def __init__(self, rail: dist.ProcessGroup, node: dist.ProcessGroup, ranks: dict[int, list[int]]):
        self.rail, self.node = rail, node
        self.ranks = ranks  # hop -> the EP ranks of its group (1: rail, 2: node)

    @classmethod
    def make(cls, group: dist.ProcessGroup | None, layout: NodeLayout, ep_rank: int, timeout_s: float) -> NodeGroups:
        """EP rank ``ep_rank``'s groups over ``layout`` of ``group`` (None: the default group), with a
        ``timeout_s`` timeout. Collective over ``group``: every rank calls it."""
        parts = [layout.rail_ranks(ep_rank), layout.node_ranks(ep_rank)]
        return cls(*step_subgroups(group, parts, timeout_s), dict(zip((1, 2), parts)))

    def __deepcopy__(self, memo: dict) -> NodeGroups:
        return self


@dataclass(frozen=True)
class NodesMeta:
    """One call of :class:`NodesDispatcher`: what :meth:`~NodesDispatcher.combine` reads."""

    arrived: Arrived
    splits: NodeSplits
    rows_nodes: TokenRows  # hop 1: the sender's rows, one per (token, node), node-major
    rows_ranks: TokenRows  # hop 2: the forwarder's rows, one per (received row, rank of its node), rank-major
    where: str  # the layer call, for errors


class NodesDispatcher(Dispatcher):
    """The two-level exchange (see the module docstring) over ``layout``'s nodes, on ``groups``."""

    name = "nodes"

    def __init__(self, layout: NodeLayout, groups: NodeGroups):
        self.layout, self.groups = layout, groups
        self.ranks_per_node = layout.ranks_per_node

    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, NodesMeta]:
        """``(x_RH, meta)``: the rows this rank's local experts run, by forwarder."""
        if link.plan is not None:
            return self._with_replicas(hidden_TH, top_k_index_TK, top_k_weights_TK, link)
        shard, counts = link.shard, link.counts
        splits: NodeSplits = counts.nodes
        P, N, e = self.layout.ranks_per_node, self.layout.nodes, shard.num_local_experts
        K, H = top_k_index_TK.shape[1], hidden_TH.shape[1]
        dtype = route_dtype(hidden_TH.dtype, top_k_weights_TK.dtype)
        route_TK2 = torch.cat([top_k_index_TK.to(dtype), top_k_weights_TK.to(dtype)], dim=1)
        rows_nodes = token_rows(top_k_index_TK, P * e, N, sum(splits.send_nodes_N))
        sent_RX = GatherRows.apply(hidden_TH, route_TK2, *rows_nodes)
        where = link.position.describe(link.channel.layer_names)
        received_RX, rows_ranks = self._both_hops(sent_RX, H, dtype, K, splits, shard, where)
        x_RH, route_RK2 = UnpackRoute.apply(received_RX, H, dtype)
        local_RK = route_RK2[:, :K].long() - shard.local_start
        local_RK = local_RK.masked_fill((local_RK < 0) | (local_RK >= e), e)
        host_counts = counts.local_counts_e
        pairs = pair_rows(local_RK, e, sum(host_counts), host_counts)
        weights_RK = route_RK2[:, K:].to(top_k_weights_TK.dtype)
        arrived = Arrived(RoutedRows(weights_RK, pairs), host_counts, None, counts.peer_guards)
        return x_RH, NodesMeta(arrived, splits, rows_nodes, rows_ranks, where)

    def _with_replicas(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, NodesMeta]:
        """:meth:`dispatch` under a replica plan (:mod:`epmoe.ep.replicas`): the rows of
        :mod:`~epmoe.ep.dispatch.replica_rows` (a row of its own per slot moved to a helper, through
        the helper's node to the helper, which the rows' ids say), through both hops, whose splits
        follow from the counts exchange and the plan (:func:`_replica_splits`)."""
        shard, counts, P = link.shard, link.counts, self.layout.ranks_per_node
        K, H = top_k_index_TK.shape[1], hidden_TH.shape[1]
        splits = _replica_splits(counts.nodes, link.plan, shard.ep_rank, P)
        num_redirected = sum(splits.send_nodes_N) - sum(counts.nodes.send_nodes_N)
        sent_RX, rows_nodes = send_with_replicas(
            hidden_TH, top_k_index_TK, top_k_weights_TK, link, counts.nodes.send_nodes_N, P, num_redirected
        )
        where = link.position.describe(link.channel.layer_names)
        dtype = route_dtype(hidden_TH.dtype, top_k_weights_TK.dtype)
        received_RX, rows_ranks = self._both_hops(sent_RX, H, dtype, K, splits, shard, where)
        x_RH, arrived = arrived_with_replicas(received_RX, H, top_k_weights_TK.dtype, link, None)
        return x_RH, NodesMeta(arrived, splits, rows_nodes, rows_ranks, where)

    def _both_hops(
        self,
        sent_RX: torch.Tensor,
        H: int,
        dtype: torch.dtype,
        K: int,
        splits: NodeSplits,
        shard: ExpertShard,
        where: str,
    ) -> tuple[torch.Tensor, TokenRows]:
        """``(received_RX, rows_ranks)``: the packed rows ``sent_RX`` (``H`` hidden columns, then the
        route: ``K`` ids in ``dtype``, ``K`` weights) through hop 1, forwarded to the rank each choice's
        id says (:meth:`~epmoe.ep.routing.RouteIds.rank_RK`; nowhere, or another node's: sent on to
        no one) through hop 2, as they arrived."""
        P, e = self.layout.ranks_per_node, shard.num_local_experts
        arrived_RX = self._hop(1, where, sent_RX, splits.recv_nodes_N, splits.send_nodes_N)
        ids_RK = arrived_RX[:, H:].clone(memory_format=torch.contiguous_format).view(dtype)[:, :K].long()
        rank_RK = RouteIds(e, shard.num_experts).rank_RK(ids_RK)
        on_node_RK = rank_RK - (shard.ep_rank // P) * P  # each choice's rank in this node; P: none here
        on_node_RK = on_node_RK.masked_fill((rank_RK < 0) | (on_node_RK < 0) | (on_node_RK >= P), P)
        rows_ranks = token_rows(on_node_RK * e, e, P + 1, sum(splits.send_ranks_P))
        forwarded_RX = GatherRows.apply(arrived_RX, None, *rows_ranks)
        received_RX = self._hop(2, where, forwarded_RX, splits.recv_ranks_P, splits.send_ranks_P)
        return received_RX, rows_ranks

    def combine(self, y_RH: torch.Tensor, meta: NodesMeta) -> torch.Tensor:
        """``(T, H)``: each row's outputs summed at its forwarder (in rank order), one row per node
        back to the sender, summed per token in node order."""
        splits, where = meta.splits, f"{meta.where}, back"
        back_RH = self._hop(2, where, y_RH, splits.send_ranks_P, splits.recv_ranks_P)
        per_node_RH = SumRows.apply(back_RH, *meta.rows_ranks)
        home_RH = self._hop(1, where, per_node_RH, splits.send_nodes_N, splits.recv_nodes_N)
        return SumRows.apply(home_RH, *meta.rows_nodes)

    def _hop(self, level: int, where: str, x: torch.Tensor, output_splits: list[int], input_splits: list[int]):
        """One hop's all-to-all-v (1: over the rail group, between nodes; 2: inside the node); a
        failure (a peer that died, or did not come within the group's timeout) raises naming the
        hop, its ranks and the layer call."""
        group = self.groups.rail if level == 1 else self.groups.node
        try:
            return all_to_all_v(x, output_splits, input_splits, group)
        except RuntimeError as exc:
            ranks = self.groups.ranks[level]
            what = (
                f"hop 1, between nodes (the rail group: EP ranks {ranks})"
                if level == 1
                else (f"hop 2, inside the node (EP ranks {ranks})")
            )
            raise RuntimeError(f"epmoe: the two-level exchange's {what} failed at {where}: {exc}") from exc


def _replica_splits(splits: NodeSplits, plan: ReplicaPlan, rank: int, P: int) -> NodeSplits:
    """The two hops' rows with the plan's moved slots added to the counts exchange's (each a row of its
    own, from its source through its helper's node to the helper): this rank's own redirected slots
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.redirected_rows_W`) and those its node's helpers get
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.rows_into`): a rail peer's pass through this rank, its own
    arrive from its sources' rail peers in this node; no loop over every source's moves."""
    node, local = divmod(rank, P)
    sent_W = plan.redirected_rows_W(rank)
    send_nodes_N = [a + sum(sent_W[n * P : (n + 1) * P]) for n, a in enumerate(splits.send_nodes_N)]
    recv_nodes_N, send_ranks_P, recv_ranks_P = (
        list(splits.recv_nodes_N),
        list(splits.send_ranks_P),
        list(splits.recv_ranks_P),
    )
    for j in range(P):  # the helpers of this rank's node
        for source, rows in plan.rows_into(node * P + j):
            if source % P == local:  # hop 1 from the source's node to this rank, hop 2 on to the helper
                recv_nodes_N[source // P] += rows
                send_ranks_P[j] += rows
            if j == local:  # this rank's own: hop 2 from the source's rail peer in this node
                recv_ranks_P[source % P] += rows
    return NodeSplits(send_nodes_N, recv_nodes_N, send_ranks_P, recv_ranks_P)
