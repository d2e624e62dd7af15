"""Which EP ranks share a node: the layout the two-level exchange (:mod:`epmoe.ep.dispatch.nodes`) follows.

A node's ranks are consecutive in the EP group, ``P`` of them on each of ``N`` nodes (EP rank
``r`` on node ``r // P``, at local index ``r % P``)::

    EP ranks   0 1 | 2 3        P = 2 ranks per node, N = 2 nodes
    node           0 |   1      node group of rank 2: [2, 3]     rail group of rank 2: [0, 2]

``P`` comes from ``ExpertParallelConfig(ranks_per_node=P)`` (to override the launcher, or to emulate
nodes on one machine), else from the launcher: torchrun's ``LOCAL_WORLD_SIZE`` and node rank
(``GROUP_RANK``, else the global rank over ``LOCAL_WORLD_SIZE``), else one node. The EP ranks agree
on it in one header exchange of each rank's node when EP is applied; a group whose ranks' nodes are
not consecutive blocks of one size, or that the size does not divide, raises on every rank naming
each rank's node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from epmoe import platform
from epmoe.comm.steps import AGREE, MODEL_WIDE, Position, StepChannel


@dataclass(frozen=True)
class NodeLayout:
    """``ranks_per_node`` EP ranks on each of ``nodes`` nodes (see the module docstring)."""

    ranks_per_node: int
    nodes: int

    def node_ranks(self, ep_rank: int) -> list[int]:
        """The EP ranks of ``ep_rank``'s node, in order."""
        first = ep_rank - ep_rank % self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def rail_ranks(self, ep_rank: int) -> list[int]:
        """The EP ranks at ``ep_rank``'s local index on every node, by node."""
        return list(range(ep_rank % self.ranks_per_node, self.nodes * self.ranks_per_node, self.ranks_per_node))


def node_layout(group, ep_rank: int, ep_size: int, ranks_per_node: int | None, timeout_s: float) -> NodeLayout:
    """The EP group's :class:`NodeLayout` (see the module docstring), agreed on by its ranks."""
    if ranks_per_node is not None:
        if ep_size % ranks_per_node:
            raise ValueError(
                f"ExpertParallelConfig(ranks_per_node): {ranks_per_node} does not divide the EP size {ep_size}"
            )
        return NodeLayout(ranks_per_node, ep_size // ranks_per_node)
    if ep_size == 1:
        return NodeLayout(1, 1)
    channel = StepChannel(group, 1, timeout_s=timeout_s, what="EP")
    rows = channel.agree(Position(MODEL_WIDE, AGREE, 0), platform.group_device(group), [], [launcher_node()])
    nodes_by_rank = [row[0] for row in rows]
    firsts = sorted(set(nodes_by_rank))
    size = nodes_by_rank.count(nodes_by_rank[0])
    expected = [firsts[r // size] for r in range(ep_size)] if ep_size % size == 0 else None
    if expected != nodes_by_rank or len(firsts) * size != ep_size:
        raise ValueError(
            f"apply_expert_parallel: the EP ranks' nodes (by EP rank, from the launcher) are {nodes_by_rank}: "
            f"a node's ranks must be consecutive in the EP group, as many on every node; set "
            f"ExpertParallelConfig(ranks_per_node=...) or launch ranks of a node consecutively (torchrun does)"
        )
    return NodeLayout(size, ep_size // size)


def launcher_node() -> int:
    """This process's node, as torchrun says (``GROUP_RANK``, else the global rank over
    ``LOCAL_WORLD_SIZE``); 0 where no launcher says."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local > 0 and dist.is_initialized():
        return dist.get_rank() // local
    return 0
