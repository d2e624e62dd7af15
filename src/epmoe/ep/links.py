"""What a byte costs on each link of the EP group, in matmul flops: the price expert replicas' plan pays.

Two classes of link join the EP ranks: *inside* a node (NVLink, HCCS, PCIe; loopback here) and
*between* nodes (InfiniBand, RoCE, Ethernet), often 5-20x slower. A move of an expert's slots from
its owner to a helper (:mod:`epmoe.ep.replicas`) is priced by the link it crosses::

    nodes by EP rank   [0, 0, 1, 1]             owner 0 -> helper 1: inside      (flops per byte: inside)
                                                owner 0 -> helper 2: between     (flops per byte: between)

:class:`LinkCosts` holds, per class, how many matmul flops the device computes in the time that link
moves one byte. Set them with ``ExpertParallelConfig(flops_per_link_byte=...)`` (a number for every
link, or ``{"inside": x, "between": y}``) where you know better, else :func:`link_costs` measures them
when EP is applied with expert replicas on: a timed matmul in the experts' dtype, then one short timed
exchange per class the group has (each rank sends ``PROBE_BYTES`` to the next rank of its node, then to
the next rank of its local index, on another node; uneven nodes included), each rank's figure rounded up to an integer and the ranks agreeing on
the largest (the slowest link for the fastest compute): the same costs on every rank by construction,
so every rank plans alike.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe import platform
from epmoe.comm.steps import AGREE, MODEL_WIDE, Position, StepChannel
from epmoe.ep.config import ExpertParallelConfig

LINK_CLASSES = ("inside", "between")
PROBE_BYTES = 4 << 20  # one timed exchange's bytes per rank
PROBE_ROWS = 1024  # rows of the timed matmul
PROBE_WIDTH = 512  # its weight's least size on each side
REPEATS = 3  # timed runs of each probe (after one untimed), the median kept


@dataclass(frozen=True)
class LinkCosts:
    """Matmul flops per byte on each link class of an EP group (see the module docstring).

    ``nodes_by_rank``: each EP rank's node; ``inside`` / ``between``: flops per byte on a link inside
    a node / between nodes; ``measured``: whether :func:`link_costs` timed them (else the config set them).
    """

    nodes_by_rank: tuple[int, ...]
    inside: float
    between: float
    measured: bool = False

    def flops_per_byte(self, source: int, destination: int) -> float:
        """Flops per byte on the link from EP rank ``source`` to EP rank ``destination``."""
        same = self.nodes_by_rank[source] == self.nodes_by_rank[destination]
        return self.inside if same else self.between


def link_costs(
    config: ExpertParallelConfig,
    channel: StepChannel,
    nodes_by_rank: list[int],
    weight: torch.Tensor,
) -> LinkCosts:
    """The EP group's :class:`LinkCosts`: ``config.flops_per_link_byte`` where set, else measured on
    ``channel``'s group (collective: every rank calls it) with a matmul shaped like one expert's
    ``weight`` (a 2-D slice of it, in its dtype, on the group's device). ``nodes_by_rank``: the same
    list on every rank (:func:`epmoe.ep.topology.nodes_of_ranks`)."""
    given = config.flops_per_link_byte
    if given is not None:
        costs = given if isinstance(given, dict) else dict.fromkeys(LINK_CLASSES, given)
        return LinkCosts(tuple(nodes_by_rank), float(costs["inside"]), float(costs["between"]))
    device = platform.group_device(channel.group)
    flops_per_s = _matmul_rate(weight, device)
    rank, W = channel.rank, channel.size
    index_W = _local_indices(nodes_by_rank)
    figures = []
    for ring_of in (nodes_by_rank, index_W):  # inside: a node's ranks; between: the ranks of one local index
        ring = [r for r in range(W) if ring_of[r] == ring_of[rank]]
        if len(set(ring_of)) == W:  # every ring of one: no link of this class in the group
            figures.append(-1)
            continue
        seconds = _exchange_time(channel.group, W, rank, ring, device)  # every rank joins; alone: sends nothing
        figures.append(-1 if len(ring) == 1 else math.ceil(flops_per_s * seconds / PROBE_BYTES))
    rows = channel.agree(Position(MODEL_WIDE, AGREE, 0), device, [], figures, caller="epmoe: link costs")
    inside, between = (max(row[i] for row in rows) for i in range(2))
    inside = inside if inside >= 0 else between  # a class the group lacks is never priced: take the other's
    between = between if between >= 0 else inside
    return LinkCosts(tuple(nodes_by_rank), float(max(inside, 0)), float(max(between, 0)), measured=True)


def _local_indices(nodes_by_rank: list[int]) -> list[int]:
    """Each EP rank's index among its node's ranks (the rank at index ``i`` on every node: a rail)."""
    seen: dict[int, int] = {}
    index_W = []
    for node in nodes_by_rank:
        index_W.append(seen.get(node, 0))
        seen[node] = index_W[-1] + 1
    return index_W


def _matmul_rate(weight: torch.Tensor, device: torch.device) -> float:
    """Flops per second of ``(PROBE_ROWS, n) @ (n, m)`` in ``weight``'s dtype on ``device``, ``(m, n)``
    a 2-D slice of ``weight`` (one expert's projection), each at least :data:`PROBE_WIDTH` (a tiny
    expert's matmul times the call overhead, not the device: its rate would swing by run)."""
    m, n = (max(size, PROBE_WIDTH) for size in weight.shape[-2:])
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    w = torch.randn(m, n, dtype=torch.float32, device=device).to(dtype)
    x = torch.randn(PROBE_ROWS, n, dtype=torch.float32, device=device).to(dtype)

    def run() -> None:
        torch.mm(x, w.T)

    return 2 * PROBE_ROWS * m * n / _median_time(run, device)


def _exchange_time(group, W: int, rank: int, peers: list[int], device: torch.device) -> float:
    """Seconds for ``PROBE_BYTES`` from this rank to the next of ``peers`` (EP ranks, this one among
    them) while the previous sends it as much: a ring over ``peers``, every rank of the group in one
    such ring (alone in its ring: it sends nothing), all rings in one collective of the group."""
    at = peers.index(rank)
    send_W, recv_W = [0] * W, [0] * W
    if len(peers) > 1:
        send_W[peers[(at + 1) % len(peers)]] = PROBE_BYTES
        recv_W[peers[(at - 1) % len(peers)]] = PROBE_BYTES
    out = torch.ones(sum(send_W), dtype=torch.uint8, device=device)
    into = torch.empty(sum(recv_W), dtype=torch.uint8, device=device)

    def run() -> None:
        dist.all_to_all_single(into, out, recv_W, send_W, group=group)

    return _median_time(run, device)


def _median_time(run, device: torch.device) -> float:
    """The median of :data:`REPEATS` timed calls of ``run`` on ``device``, after one untimed."""
    run()
    platform.synchronize(device)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        platform.synchronize(device)
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)
