"""A layer forward's counts exchange: the one host read of an EP layer on the counts-based transports.

Every rank learns how many slots it sends to and receives for each expert and how many rows it sends
to and receives from each rank (:class:`LayerCounts`), in one header exchange at the layer's
position (:func:`epmoe.comm.counts.exchange_counts_on`: the step header and the step guard's values
ride along). With ``W = 2`` ranks and ``e = 2`` local experts::

    rank 0 slots per global expert [a0 a1 | a2 a3]    rank 1 [b0 b1 | b2 b3]
    rank 0 send_counts_WE [a0 a1 a2 a3]   recv_counts_WE [a0 a1 | b0 b1]   local_counts_e [a0+b0, a1+b1]
    rank 1 send_counts_WE [b0 b1 b2 b3]   recv_counts_WE [a2 a3 | b2 b3]   local_counts_e [a2+b2, a3+b3]

A rank sends a token once to each rank holding one of its experts: its rows per rank
(:func:`~epmoe.ep.routing.destinations_TW`) travel in the same exchange. With expert replicas
(``replica_key``) each rank also sends every peer its whole histogram, so every rank learns the
call's slot matrix ``slots_WE`` (rank s, global expert g), which :mod:`epmoe.ep.replicas` plans from,
and the rest of what the plan takes, which the ranks check is the same. With the two-level exchange
(``ranks_per_node``) each sender also tells its rail peers the rows it sends their node and what they
forward to each rank there (:class:`NodeSplits`, :mod:`epmoe.ep.dispatch.nodes`). What a row holds,
column by column, is :class:`CountsRow`'s: the one place that knows the columns and the width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.counts import exchange_counts_on
from epmoe.comm.steps import Position, StepChannel
from epmoe.ep.config import ExpertShard
from epmoe.ep.routing import destinations_TW

GUARD = 4  # the step guard's values in each row (epmoe.ep.guard: verdict, factor, tolerance, fingerprint; zeros where it does not run)


@dataclass(frozen=True)
class CountsRow:
    """The columns of one sender's row to one peer in a layer's counts exchange::

        counts     e        its slots per expert of the peer     (epmoe.comm.counts: with the two below)
        total      1        its slots in all
        dtype      1        the dtype of the rows about to travel
        rows       1        its rows for the peer                (the extra columns start here)
        guard      GUARD    the step guard's values              (epmoe.ep.guard; zeros where it does not run)
        key        2        the replica plan's key               (with expert replicas: experts > 0)
        slots      E        its slots per global expert          (with expert replicas)
        nodes      1 + P    the two-level exchange's splits      (with ranks_per_node > 0: _node_columns)

    ``local_experts`` = e; ``experts`` = E where replicas ride (else 0); ``ranks_per_node`` = P where
    the two-level exchange's splits ride (else 0). The extra columns' slices index what
    :func:`~epmoe.comm.counts.exchange_counts_on` returns of them."""

    local_experts: int
    experts: int = 0
    ranks_per_node: int = 0

    @property
    def width(self) -> int:
        """The row's values: what the step channel must carry."""
        return self.local_experts + 2 + self.nodes.stop

    rows = 0
    guard = slice(1, 1 + GUARD)
    key = slice(1 + GUARD, 3 + GUARD)  # the fewest slots worth a move inside a node, between nodes

    @property
    def slots(self) -> slice:
        return slice(self.key.stop, self.key.stop + self.experts)

    @property
    def nodes(self) -> slice:
        start = self.slots.stop if self.experts else self.key.start
        return slice(start, start + (1 + self.ranks_per_node if self.ranks_per_node else 0))

    @staticmethod
    def widest(shards: list[ExpertShard], replicas: bool, ranks_per_node: int | None) -> int:
        """The widest row of any of ``shards``' layers: the width of the channel they share."""
        return max(
            CountsRow(s.num_local_experts, s.num_experts if replicas else 0, ranks_per_node or 0).width for s in shards
        )


@dataclass(frozen=True)
class NodeSplits:
    """The two-level exchange's rows (:mod:`epmoe.ep.dispatch.nodes`), on the host: to and from each
    node (over this rank's rail group, by node), then to and from each rank of this rank's node."""

    send_nodes_N: list[int]  # (N,) rows this rank sends each node (its tokens with an expert there)
    recv_nodes_N: list[int]  # (N,) rows this rank receives from its rail peer on each node
    send_ranks_P: list[int]  # (P,) rows this rank forwards to each rank of its node
    recv_ranks_P: list[int]  # (P,) rows this rank receives from each rank of its node


@dataclass(frozen=True, kw_only=True)
class LayerCounts:
    """What one layer forward's counts exchange told this rank, on the host (see the module docstring)."""

    send_counts_WE: list[int]  # (W*e,) slots this rank sends to expert (r, j), rank-major
    recv_counts_WE: list[int]  # (W*e,) slots this rank receives from rank s for local expert j, (s, j)
    local_counts_e: list[int]  # (e,) slots per local expert j, summed over source ranks: the grouped matmuls' counts
    group: dist.ProcessGroup | None  # the group the rows travel on (the step channel's; None on a single rank)
    global_slots: int  # slots of every rank of the EP group in this forward (T_global * K)
    send_rows_W: list[int]  # (W,) rows this rank sends to each rank (empty on a single rank)
    recv_rows_W: list[int]  # (W,) rows this rank receives from each rank (empty on a single rank)
    peer_guards: list[list[int]] | None  # (W, GUARD) the step guard's values by source, where they travelled
    slots_WE: list[list[int]] | None = None  # (W, E) every rank's slots per global expert (with replicas)
    nodes: NodeSplits | None = None  # the two-level exchange's rows (ranks_per_node)


def exchange_layer_counts(
    channel: StepChannel | None,
    position: Position,
    shard: ExpertShard,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    guard: torch.Tensor | None = None,
    replica_key: tuple[int, int] | None = None,
    ranks_per_node: int | None = None,
) -> LayerCounts:
    """The counts exchange of a layer forward at ``position`` (see the module docstring): this rank's
    slots per global expert from ``top_k_index_TK`` and its rows per rank, with the EP group on
    ``channel`` (``None``: a group of one, nothing exchanged; one host read either way). The ranks
    also agree that their rows travel in ``hidden_TH``'s dtype; ``guard``: the step guard's
    ``(GUARD,)`` values to send, where it runs; ``replica_key`` (with expert replicas: what the
    replica plan takes besides the counts, its fewest slots worth a move inside a node and between
    nodes, which must be the same on every rank): every rank also learns the whole slot matrix (``slots_WE``), and the ranks raise,
    every one, where their keys differ (their plans would); ``ranks_per_node`` (the two-level
    exchange's ``P``): each rank also learns its :class:`NodeSplits` (:func:`_node_columns`)."""
    expert_S = top_k_index_TK.reshape(-1)
    slots_E = torch.zeros(shard.num_experts, dtype=torch.int64, device=expert_S.device)
    slots_E.scatter_add_(0, expert_S, torch.ones_like(expert_S))
    if channel is None:
        return _alone(slots_E.tolist(), replica_key is not None)
    W, e = channel.size, shard.num_local_experts
    row = CountsRow(e, shard.num_experts if replica_key is not None else 0, ranks_per_node or 0)
    dest_TW = destinations_TW(top_k_index_TK, e, W)
    rows_W = dest_TW.sum(0)
    guard_values = slots_E.new_zeros(GUARD) if guard is None else guard
    columns = [rows_W.view(W, 1), guard_values.view(1, -1).expand(W, -1)]
    if replica_key is not None:
        columns.append(torch.cat([slots_E.new_tensor(replica_key), slots_E]).view(1, -1).expand(W, -1))
    if ranks_per_node is not None:
        columns.append(_node_columns(dest_TW, channel.rank, ranks_per_node))
    exchanged = exchange_counts_on(channel, position, slots_E, hidden_TH.dtype, torch.cat(columns, dim=1))
    received = exchanged.extras_received
    if replica_key is not None:
        _check_replica_keys([tuple(peer[row.key]) for peer in received], position.describe(channel.layer_names))
    recv = exchanged.recv_counts
    return LayerCounts(
        send_counts_WE=exchanged.send_counts,
        recv_counts_WE=recv,
        local_counts_e=[sum(recv[s * e + j] for s in range(W)) for j in range(e)],
        group=channel.group,
        global_slots=sum(exchanged.slots_by_rank),
        send_rows_W=[peer[row.rows] for peer in exchanged.extras_sent],
        recv_rows_W=[peer[row.rows] for peer in received],
        peer_guards=[peer[row.guard] for peer in received] if guard is not None else None,
        slots_WE=[peer[row.slots] for peer in received] if replica_key is not None else None,
        nodes=None if ranks_per_node is None else _node_splits(exchanged, row.nodes, channel.rank, ranks_per_node),
    )


def _alone(slots: list[int], replicas: bool) -> LayerCounts:
    """A group of one's :class:`LayerCounts`: its own ``slots`` per expert, nothing exchanged."""
    return LayerCounts(
        send_counts_WE=slots,
        recv_counts_WE=slots,
        local_counts_e=slots,
        group=None,
        global_slots=sum(slots),
        send_rows_W=[],
        recv_rows_W=[],
        peer_guards=None,
        slots_WE=[slots] if replicas else None,
    )


def _node_columns(dest_TW: torch.Tensor, rank: int, P: int) -> torch.Tensor:
    """``(W, 1 + P)``: what this rank tells each peer of its two-level exchange (the last columns of
    its rows): a peer at this rank's local index on node ``n`` (its rail peer there) gets the rows this
    rank sends node ``n`` (its tokens with an expert there) and, per rank ``j`` of node ``n``, its
    tokens with an expert on ``j`` (what the rail peer forwards to ``j``); the others get zeros."""
    T, W = dest_TW.shape
    rows_NP = dest_TW.sum(0).view(W // P, P)
    nodes_N = dest_TW.view(T, W // P, P).amax(2).sum(0)
    rail_W = (torch.arange(W, device=dest_TW.device) % P == rank % P).to(torch.int64)
    per_peer = torch.cat([nodes_N.view(-1, 1), rows_NP], dim=1).repeat_interleave(P, dim=0)
    return per_peer * rail_W.view(W, 1)


def _node_splits(exchanged, columns: slice, rank: int, P: int) -> NodeSplits:
    """This rank's :class:`NodeSplits`, from what the counts exchange carried in the row's node
    ``columns`` (:func:`_node_columns`) and its rows column."""
    W = len(exchanged.extras_sent)
    sent = [peer[columns] for peer in exchanged.extras_sent]
    received = [peer[columns] for peer in exchanged.extras_received]
    rail = range(rank % P, W, P)  # this rank's rail peers, by node
    return NodeSplits(
        send_nodes_N=[sent[r][0] for r in rail],
        recv_nodes_N=[received[r][0] for r in rail],
        send_ranks_P=[sum(received[r][1 + j] for r in rail) for j in range(P)],
        recv_ranks_P=[
            sum(exchanged.extras_received[s][CountsRow.rows] for s in range(W) if s % P == j) for j in range(P)
        ],
    )


def _check_replica_keys(keys_W: list[tuple[int, int]], where: str) -> None:
    """``ValueError`` (on every rank: they all received the same keys) where the ranks' replica plans
    would differ."""
    if len(set(keys_W)) > 1:
        raise ValueError(
            f"epmoe: the EP ranks would plan expert replicas differently at {where}: their fewest slots worth "
            f"moving an expert (inside a node, between nodes) are {keys_W} by rank (-1: none; the cost model, "
            f"epmoe.ep.replicas, reads the experts' dtype and whether they train: every rank must run the model "
            f"in the same dtype and the same mode, train() or eval())"
        )
