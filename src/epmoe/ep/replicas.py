"""Expert replicas: a layer call's plan to compute a hot expert's rows on other ranks too.

Under expert parallelism each layer waits for its most loaded rank. With
``ExpertParallelConfig(replicas=N)`` a layer call may move some of a hot expert's *slots* (its
(token, k) choices) from the expert's owner to *helper* ranks, each helper computing the rows of at
most ``N`` experts it does not own. The helper gets the expert's weights for this call only, through
a differentiable exchange (:func:`epmoe.comm.replicas.lend_expert_weights`): the copy's gradient goes
back to the owner and is added into the owner's gradient in the exchange's backward, before anything
reduces it.
Nothing of a replica is a parameter, optimizer state or a checkpoint entry; the outputs and every
gradient are those of the model without replicas (sums in another order).

The plan (:func:`plan_replicas`) is a function of the call's slot matrix ``slots_WE`` (the slots
each rank sends each global expert), which the counts exchange hands every rank alike when replicas
are on (:func:`epmoe.ep.counts.exchange_layer_counts`, ``replica_key``), of the config, which the
ranks agreed on when EP was applied, and of the cost model's key (:func:`min_rows`), which rides in
the same exchange and which the ranks check is the same: every rank computes the same plan, with no
extra host read and no extra collective. Greedy and deterministic (ties to the lowest rank, then the lowest expert):
while the most loaded rank is above the mean, its hottest expert's slots move to the least loaded
rank with room (below the mean, fewer than ``N`` replicas; at equal load one on the owner's node
first), as many as bring either to the mean::

    slots per rank [1505 543]  (mean 1024)   rank 0 owns experts 0-3, expert 0 the hottest
    move: expert 0, owner 0 -> helper 1, its last 481 slots in the global order   ->  [1024 1024]

Each move is priced by the link it crosses (:mod:`epmoe.ep.links`: inside a node or between nodes):
where the least loaded helper is on another node and the move would not pay there, a helper on the
owner's node is tried before the plan stops.

An expert's slots are taken in the *global order* (source rank, then token, then k): the owner keeps
the first, each move takes the next consecutive range (:class:`Move` ``start``, ``stop``), so each
source finds which of its slots go to a helper from the slot matrix alone (:meth:`ReplicaPlan.redirected`).

**The cost model** (:func:`min_rows`): a move is worth making only if the rows it takes off the hot
rank save more compute time than the bytes it adds cost on the link. With ``F`` weight elements per
expert, hidden size ``H``, ``b`` bytes per element and ``rho`` the flops per byte of the link the move
crosses, inside a node or between nodes (:mod:`epmoe.ep.links`, measured when EP is applied or set by
the config; :meth:`epmoe.ep.experts.LocalExperts.replica_min_rows`), a training step moves the weights there and their
gradient back (``2 F b`` bytes) and each moved slot one extra row each way, forward and backward
(``4 H b``), and saves ``6 F`` flops per slot (forward and backward of both projections)::

    m * 6F / flops  >  (2 F b + m * 4 H b) / link     =>     m  >  2 F b rho / (6 F - 4 H b rho)

(a forward whose experts get no gradient: ``F b rho / (2 F - 2 H b rho)``; which one a call takes
follows the experts, not grad mode: :meth:`epmoe.ep.experts.LocalExperts.weights_trained`, so a
forward checkpointed without gradients plans as its recompute does). Moves of fewer slots are not
made; where the denominator is not positive, nothing is ever moved.

What a rank does with the plan: a source sends each redirected slot as a row of its own to the
helper (its token's row to the owner still travels, for the owner's other experts), so every rank's
send and receive counts follow from the slot matrix and the plan (:meth:`ReplicaPlan.redirected`);
a helper numbers its replicas ``e, e+1, ...`` after its own ``e`` local experts (its rows' ids say
which: :class:`epmoe.ep.routing.RouteIds`), in the order of :meth:`ReplicaPlan.received`, which the
owners' sends follow (:meth:`ReplicaPlan.sent`), and runs them by a second routed-MLP op on the same rows.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple


class Move(NamedTuple):
    """Slots ``[start, stop)`` of global expert ``expert``, in the global order (source rank, token,
    k), computed by rank ``helper`` instead of ``owner`` (a tuple: made in the planner's loop)."""

    expert: int
    owner: int
    helper: int
    start: int
    stop: int

    @property
    def slots(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ReplicaPlan:
    """One layer call's replicas (see the module docstring): its ``moves`` (in the order made) over
    ``W`` ranks of ``e`` experts each, and the slot matrix it was planned from.

    Every table a query reads is made once, with the plan: each expert's slots (``load_E``, given by
    the planner, which has them already); for each moved expert, the prefix sums over source ranks of its column from the first
    source its moves take slots of (the sources before keep all theirs), summed back from the last
    source, so ``O(the sources its moves touch)``; each rank's sent and received moves and each move's
    replica index. A query about one source then costs ``O(moves)``, one about a helper's sources
    ``O(its moves x the sources they take slots of)``; none ``O(W x moves)``."""

    moves: tuple[Move, ...]
    slots_WE: Sequence[Sequence[int]]  # (W, E) slots rank s sends global expert g, as given (not copied)
    experts_per_rank: int
    load_E: list[int] | None = field(default=None, repr=False, compare=False)  # (E,) slots of each expert
    _tails: dict[int, tuple[int, list[int]]] = field(init=False, repr=False, compare=False)  # see _tail
    _sent: dict[int, list[Move]] = field(init=False, repr=False, compare=False)  # owner -> its moves, sent() order
    _received: dict[int, list[Move]] = field(init=False, repr=False, compare=False)  # helper -> received() order
    _replica: dict[Move, int] = field(init=False, repr=False, compare=False)  # move -> its helper's local expert
    _moved_W: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        e, W = self.experts_per_rank, len(self.slots_WE)
        sent, received, moved_W = {}, {}, [0] * W
        for move in self.moves:
            sent.setdefault(move.owner, []).append(move)
            received.setdefault(move.helper, []).append(move)
            moved_W[move.owner] -= move.stop - move.start
            moved_W[move.helper] += move.stop - move.start
        for moves in sent.values():
            moves.sort(key=itemgetter(2, 0))  # helper, expert
        replica = {}
        for moves in received.values():
            moves.sort(key=itemgetter(1, 0))  # owner, expert
            replica.update((m, e + i) for i, m in enumerate(moves))
        load_E = list(map(sum, zip(*self.slots_WE))) if self.load_E is None else self.load_E
        first_E = {}  # moved expert -> the first of its slots a move takes (global order)
        for move in self.moves:
            first_E[move.expert] = min(move.start, first_E.get(move.expert, move.start))
        tables = {
            "load_E": load_E,
            "_tails": {g: _tail(self.slots_WE, g, load_E[g], first) for g, first in first_E.items()},
            "_sent": sent,
            "_received": received,
            "_replica": replica,
            "_moved_W": tuple(moved_W),
        }
        for name, table in tables.items():  # frozen: set once, here
            object.__setattr__(self, name, table)

    @property
    def ep_size(self) -> int:
        return len(self.slots_WE)

    def sent(self, rank: int) -> list[Move]:
        """The moves whose expert ``rank`` owns, in the order its weights are sent: by helper, then expert."""
        return list(self._sent.get(rank, ()))

    def received(self, rank: int) -> list[Move]:
        """The moves ``rank`` helps with, in the order its replicas run (local experts ``e, e+1, ...``):
        by owner, then expert (the order of the owners' sends, source-major)."""
        return list(self._received.get(rank, ()))

    def replica_index(self, move: Move) -> int:
        """The local expert the helper runs ``move``'s rows as (``e`` + its place in :meth:`received`)."""
        return self._replica[move]

    def redirected(self, source: int, move: Move) -> tuple[int, int]:
        """``[lo, hi)``: the positions among ``source``'s own slots of ``move.expert`` (in token, k
        order) that ``move`` takes; ``hi - lo`` slots travel from ``source`` to the helper as rows of their own."""
        first_source, before = self._tails[move.expert]
        if source < first_source:  # it keeps all its slots of the expert
            return (0, 0)
        first, last = before[source - first_source], before[source - first_source + 1]
        lo, hi = max(move.start - first, 0), min(move.stop - first, last - first)
        return (lo, hi) if lo < hi else (0, 0)

    def moves_from(self, source: int) -> list[list[int]]:
        """``[expert, lo, hi, helper, lent]`` per move that takes slots of ``source``
        (:meth:`redirected`), ``lent`` the helper's lent expert it runs them as (its place in
        :meth:`received`, from 0), in the order the moves were made: what
        :func:`epmoe.ep.routing.redirected_slots` reads."""
        e, out = self.experts_per_rank, []
        for move in self.moves:
            lo, hi = self.redirected(source, move)
            if lo < hi:
                out.append([move.expert, lo, hi, move.helper, self._replica[move] - e])
        return out

    def redirected_rows_W(self, source: int) -> list[int]:
        """``(W,)`` rows of their own ``source`` sends each helper (its redirected slots)."""
        rows_W = [0] * self.ep_size
        for move in self.moves:
            lo, hi = self.redirected(source, move)
            rows_W[move.helper] += hi - lo
        return rows_W

    def rows_into(self, helper: int) -> list[tuple[int, int]]:
        """``(source, rows)`` per source and move that sends ``helper`` redirected slots (``rows > 0``),
        by move (:meth:`received` order), then source: the rows of their own each source sends it."""
        out = []
        for move in self._received.get(helper, ()):
            first_source, before = self._tails[move.expert]
            i = bisect_right(before, move.start) - 1  # the source holding the move's first slot
            while i + 1 < len(before) and before[i] < move.stop:
                rows = min(move.stop, before[i + 1]) - max(move.start, before[i])
                if rows > 0:
                    out.append((first_source + i, rows))
                i += 1
        return out

    def lending(self, rank: int) -> tuple[list[int], list[int], list[int]]:
        """``(send_index, send_W, recv_W)``: the weight exchange's
        (:func:`epmoe.comm.replicas.lend_expert_weights`) for ``rank``: the local experts it lends, in
        :meth:`sent` order, how many to each helper and how many each owner lends it."""
        e, W = self.experts_per_rank, self.ep_size
        send_W, recv_W = [0] * W, [0] * W
        sent = self._sent.get(rank, ())
        for move in sent:
            send_W[move.helper] += 1
        for move in self._received.get(rank, ()):
            recv_W[move.owner] += 1
        return [m.expert - rank * e for m in sent], send_W, recv_W

    def moved_W(self) -> list[int]:
        """``(W,)`` slots the plan moves onto (+) and off (-) each rank."""
        return list(self._moved_W)

    def computed_rows_W(self) -> list[int]:
        """``(W,)`` slots each rank computes under the plan (its replicas' included)."""
        e = self.experts_per_rank
        return [sum(self.load_E[r * e : (r + 1) * e]) + moved for r, moved in enumerate(self._moved_W)]

    def local_counts(self, rank: int) -> list[int]:
        """``(e + n,)`` slots each of ``rank``'s local experts computes, then each of its ``n`` replicas."""
        e = self.experts_per_rank
        counts = list(self.load_E[rank * e : (rank + 1) * e])
        for move in self._sent.get(rank, ()):
            counts[move.expert - rank * e] -= move.slots
        return counts + [move.slots for move in self._received.get(rank, ())]


def _tail(slots_WE, expert: int, load: int, first: int) -> tuple[int, list[int]]:
    """``(s0, before)``: the first source ``s0`` holding ``expert``'s slots from ``first`` on (in the
    global order; its column of ``slots_WE`` sums to ``load``), and ``before[i]``: the expert's slots
    of the sources before ``s0 + i``, for ``i`` up to ``W - s0`` (``before[-1] = load``). Summed back
    from the last source: ``O(W - s0)``."""
    source, before, out = len(slots_WE), load, [load]
    while before > first:
        source -= 1
        before -= slots_WE[source][expert]
        out.append(before)
    out.reverse()
    return source, out


def min_rows(weight_elements: int, hidden: int, element_size: int, flops_per_byte: float, backward: bool) -> float:
    """The fewest slots worth moving one expert for (the cost model of the module docstring):
    ``inf`` where no number is."""
    F, H, b = weight_elements, hidden, element_size
    if backward:
        gain, weight_bytes, row_bytes = 6 * F, 2 * F * b, 4 * H * b
    else:
        gain, weight_bytes, row_bytes = 2 * F, F * b, 2 * H * b
    net = gain - row_bytes * flops_per_byte
    return weight_bytes * flops_per_byte / net if net > 0 else math.inf


def plan_replicas(
    slots_WE: list[list[int]],
    experts_per_rank: int,
    replicas: int,
    least: float,
    *,
    between: float | None = None,
    nodes_W: Sequence[int] | None = None,
) -> ReplicaPlan:
    """The call's plan (see the module docstring) for the slot matrix ``slots_WE`` (``W`` lists of
    ``E`` ints, identical on every rank), ``replicas`` experts per helper at most, moves of fewer
    than ``least`` slots not made (:func:`min_rows`); with ``nodes_W`` (each rank's node), a move
    between nodes needs ``between`` slots instead, and a helper on the owner's node is taken before
    one elsewhere at equal load (then before a less loaded one elsewhere whose move would not pay).

    ``O(W x E + moves x (log W + e))``: the ranks above the mean wait in a heap by load (most loaded,
    then lowest rank, first), those with room in another (least loaded, then lowest rank, first) and
    in one per node; a move changes only its owner's and its helper's loads: the owner goes back in
    where it still belongs (an owner never drops below the mean), the helper is pushed at its new
    load (a helper never rises above the mean) and its older entries are dropped when they surface."""
    W, e = len(slots_WE), experts_per_rank
    node_W = nodes_W if nodes_W is not None else [0] * W
    least_between = least if between is None else between
    load_E = list(map(sum, zip(*slots_WE)))  # zip's tuples reused: no (E, W) copy
    keep_E = list(load_E)  # slots each expert's owner still computes
    load_W = [sum(load_E[r * e : (r + 1) * e]) for r in range(W)]
    target = math.ceil(sum(load_W) / W)
    helped_W = [0] * W  # replicas each rank computes
    lent = set()  # (expert, helper) of each move made
    above, room, room_by_node = _heaps(load_W, target, replicas, node_W)

    def move_to(owner: int, helper: int) -> tuple[int, int] | None:  # (expert, slots) of a move that pays
        expert = _hottest(owner, helper, e, keep_E, lent)
        if expert is None:
            return None
        slots = min(load_W[owner] - target, target - load_W[helper], keep_E[expert])
        return (expert, slots) if slots >= (least if node_W[helper] == node_W[owner] else least_between) else None

    moves = []
    while above:
        owner = above[0][1]
        anywhere, near = _top(room, load_W), _top(room_by_node.get(node_W[owner], []), load_W)
        if anywhere is None:
            break
        helpers = [near] if near is not None and load_W[near] == load_W[anywhere] else [anywhere, near]
        made = next(((h, m) for h in helpers if h is not None and (m := move_to(owner, h)) is not None), None)
        if made is None:
            break
        helper, (expert, slots) = made
        keep_E[expert] -= slots  # the owner keeps the first slots; this move takes the ones just after
        moves.append(Move(expert, owner, helper, keep_E[expert], keep_E[expert] + slots))
        load_W[owner] -= slots
        load_W[helper] += slots
        helped_W[helper] += 1
        lent.add((expert, helper))
        _requeue(above, room, room_by_node[node_W[helper]], owner, helper, load_W, target, helped_W[helper] < replicas)
    return ReplicaPlan(tuple(moves), slots_WE, e, load_E)


def _top(heap: list, load_W: list[int]) -> int | None:
    """The least loaded rank with room in ``heap`` (entries at an older load than ``load_W``'s dropped)."""
    while heap and heap[0][0] != load_W[heap[0][1]]:
        heapq.heappop(heap)
    return heap[0][1] if heap else None


def _hottest(owner: int, helper: int, e: int, keep_E: list[int], lent: set) -> int | None:
    """The hottest (then lowest) expert of ``owner`` that still has slots and ``helper`` was not lent."""
    expert = None
    for g in range(owner * e, (owner + 1) * e):
        if keep_E[g] > 0 and (g, helper) not in lent and (expert is None or keep_E[g] > keep_E[expert]):
            expert = g
    return expert


def _heaps(load_W: list[int], target: int, replicas: int, node_W: Sequence[int]) -> tuple[list, list, dict]:
    """``(above, room, room_by_node)``: the ranks above ``target`` by ``-load`` then rank, those with
    room (below it, where ``replicas`` allows any) by load then rank, and the latter per node; heaps."""
    above = [(-load, r) for r, load in enumerate(load_W) if load > target]
    room = [(load, h) for h, load in enumerate(load_W) if load < target and replicas > 0]
    room_by_node: dict[int, list] = {}
    for entry in room:
        room_by_node.setdefault(node_W[entry[1]], []).append(entry)
    for heap in (above, room, *room_by_node.values()):
        heapq.heapify(heap)
    return above, room, room_by_node


def _requeue(
    above: list, room: list, near: list, owner: int, helper: int, load_W: list[int], target: int, more: bool
) -> None:
    """After a move: ``owner`` back in ``above`` at its new load while above ``target`` (else out, as
    the top it is); ``helper`` pushed into ``room`` and its node's heap ``near`` at its new load while
    below ``target`` and it may take ``more`` replicas (else its entries, at older loads, never surface
    again), the old top of ``room`` dropped when it surfaces (:func:`_top`)."""
    if load_W[owner] > target:
        heapq.heapreplace(above, (-load_W[owner], owner))
    else:
        heapq.heappop(above)
    if load_W[helper] < target and more:
        heapq.heappush(room, (load_W[helper], helper))
        heapq.heappush(near, (load_W[helper], helper))
