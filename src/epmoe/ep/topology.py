"""Which EP ranks share a node, and the one decision whether an EP group runs the two-level exchange.

A node's ranks are consecutive in the EP group, ``P`` of them on each of ``N`` nodes (EP rank
``r`` on node ``r // P``, at local index ``r % P``)::

    EP ranks   0 1 | 2 3        P = 2 ranks per node, N = 2 nodes
    node           0 |   1      node group of rank 2: [2, 3]     rail group of rank 2: [0, 2]

``P`` comes from ``ExpertParallelConfig(ranks_per_node=P)`` (to override the launcher, or to emulate
nodes on one machine), else from the launcher: torchrun's node rank (``GROUP_RANK``, else the global
rank over ``LOCAL_WORLD_SIZE``), else one node. The EP ranks agree on each rank's node in one header
exchange when EP is applied, so every rank of the group decides alike (:func:`two_level_layout`, the
one decision, for :func:`epmoe.apply_expert_parallel` and for transformers' EP alike). An EP group
whose ranks do not sit on nodes as consecutive blocks of one size cannot run the two-level exchange::

    nodes by EP rank   [0, 0, 1, 1]   two nodes of 2: the two-level exchange
                       [0, 1, 1, 1]   uneven blocks      "auto": the per-rank exchange, one log line
                       [0, 0, 0, 1]   uneven blocks      says why; "nodes": ValueError on every rank
                       [0, 1, 0, 1]   not consecutive    naming each rank's node

Under ``dispatch="auto"`` such a group takes the per-rank exchange, as does a group on one node or
with one rank per node: ``"auto"`` never raises on a layout, so an EP group never leaves another
waiting (each group decides from its own ranks' nodes: groups of one world may take different
transports, each exact).
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from epmoe import platform
from epmoe.comm.steps import AGREE, MODEL_WIDE, Position, StepChannel
from epmoe.ep.config import ExpertParallelConfig

logger = logging.getLogger(__name__)


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


def nodes_of_ranks(config: ExpertParallelConfig, group, ep_size: int, timeout_s: float) -> list[int]:
    """Each EP rank's node, by EP rank, the same list on every rank of the group: from
    ``config.ranks_per_node`` (``P``: EP rank ``r`` on node ``r // P``), else as the launcher says
    (one header exchange over the group, :func:`launcher_nodes`)."""
    size = config.ranks_per_node
    if size is None:
        return launcher_nodes(group, ep_size, timeout_s)
    if ep_size % size:
        raise ValueError(f"ExpertParallelConfig(ranks_per_node): {size} does not divide the EP size {ep_size}")
    return [r // size for r in range(ep_size)]


def two_level_layout(
    config: ExpertParallelConfig, nodes_by_rank: list[int], ep_rank: int, *, shares_batch: bool = False
) -> NodeLayout | None:
    """The :class:`NodeLayout` the EP group's two-level exchange follows where ``config`` has it run
    (``dispatch="nodes"``; ``"auto"`` over more than one node with more than one EP rank on each,
    dropless), ``None`` where the group takes the per-rank exchange (see the module docstring);
    ``nodes_by_rank``: :func:`nodes_of_ranks`, the same on every rank, so every rank decides alike;
    ``shares_batch``: the group's ranks hold one batch (transformers' TP group), nothing to exchange.
    ``ValueError`` (on every rank) for ``dispatch="nodes"`` on a layout it cannot serve."""
    if len(nodes_by_rank) == 1 or shares_batch or config.dispatch not in ("auto", "nodes"):
        return None
    if config.dispatch == "auto" and config.capacity_factor is not None:  # capacity's order: the per-rank exchange
        return None
    layout = layout_of(nodes_by_rank)
    if layout is None:
        why = f"the EP ranks' nodes (by EP rank, from the launcher) are {nodes_by_rank}, not consecutive blocks of one size"
        if config.dispatch == "nodes":
            raise ValueError(
                f"ExpertParallelConfig(dispatch='nodes'): {why}: the two-level exchange needs a node's ranks "
                f"consecutive in the EP group, as many on every node; make EP groups of whole nodes (or of "
                f"equal consecutive parts of them), set ranks_per_node, or use dispatch='auto'"
            )
        if ep_rank == 0:
            logger.warning("epmoe: dispatch='auto' takes the per-rank exchange: %s", why)
        return None
    if config.dispatch == "auto" and (layout.nodes == 1 or layout.ranks_per_node == 1):
        return None
    return layout


def layout_of(nodes_by_rank: list[int]) -> NodeLayout | None:
    """The :class:`NodeLayout` of EP ranks on nodes ``nodes_by_rank`` (a node id per EP rank), or
    ``None`` where a node's ranks are not consecutive or the nodes hold different numbers of them."""
    runs = [(node, len(list(ranks))) for node, ranks in itertools.groupby(nodes_by_rank)]
    sizes = {size for _, size in runs}
    if len(sizes) != 1 or len({node for node, _ in runs}) != len(runs):
        return None
    return NodeLayout(sizes.pop(), len(runs))


def launcher_nodes(group, ep_size: int, timeout_s: float) -> list[int]:
    """Each EP rank's node as its launcher says (:func:`launcher_node`), by EP rank, the same list on
    every rank of the group (one header exchange)."""
    if ep_size == 1:
        return [launcher_node()]
    channel = StepChannel(group, 1, timeout_s=timeout_s, what="EP")
    rows = channel.agree(Position(MODEL_WIDE, AGREE, 0), platform.group_device(group), [], [launcher_node()])
    return [row[0] for row in rows]


def launcher_node() -> int:
    """This process's node, as torchrun says (``GROUP_RANK``, else the global rank over
    ``LOCAL_WORLD_SIZE``); 0 where no launcher says."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local > 0 and dist.is_initialized():
        return dist.get_rank() // local
    return 0
