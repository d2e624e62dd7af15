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
rank with room (below the mean, fewer than ``N`` replicas), as many as bring either to the mean::

    slots per rank [1505 543]  (mean 1024)   rank 0 owns experts 0-3, expert 0 the hottest
    move: expert 0, owner 0 -> helper 1, its last 481 slots in the global order   ->  [1024 1024]

An expert's slots are taken in the *global order* (source rank, then token, then k): the owner keeps
the first, each move takes the next consecutive range (:class:`Move` ``start``, ``stop``), so each
source finds which of its slots go to a helper from the slot matrix alone (:meth:`ReplicaPlan.redirected`).

**The cost model** (:func:`min_rows`): a move is worth making only if the rows it takes off the hot
rank save more compute time than the bytes it adds cost on the link. With ``F`` weight elements per
expert, hidden size ``H``, ``b`` bytes per element and ``rho`` the device's flops per link byte
(:func:`epmoe.platform.flops_per_link_byte`; :meth:`epmoe.ep.experts.LocalExperts.replica_min_rows`), a training step moves the weights there and their
gradient back (``2 F b`` bytes) and each moved slot one extra row each way, forward and backward
(``4 H b``), and saves ``6 F`` flops per slot (forward and backward of both projections)::

    m * 6F / flops  >  (2 F b + m * 4 H b) / link     =>     m  >  2 F b rho / (6 F - 4 H b rho)

(a forward without gradients: ``F b rho / (2 F - 2 H b rho)``). Moves of fewer slots are not made;
where the denominator is not positive, nothing is ever moved.

What a rank does with the plan: a source sends each redirected slot as a row of its own to the
helper (its token's row to the owner still travels, for the owner's other experts), so every rank's
send and receive counts follow from the slot matrix and the plan (:meth:`ReplicaPlan.redirected`);
a helper numbers its replicas ``e, e+1, ...`` after its own ``e`` local experts (its rows' ids say
which), in the order of :meth:`ReplicaPlan.received`, which the owners' sends follow
(:meth:`ReplicaPlan.sent`), and runs them by a second routed-MLP op on the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    """Slots ``[start, stop)`` of global expert ``expert``, in the global order (source rank, token,
    k), computed by rank ``helper`` instead of ``owner``."""

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
    ``W`` ranks of ``e`` experts each, and the slot matrix it was planned from."""

    moves: tuple[Move, ...]
    slots_WE: tuple[tuple[int, ...], ...]  # (W, E) slots rank s sends global expert g
    experts_per_rank: int

    @property
    def ep_size(self) -> int:
        return len(self.slots_WE)

    def sent(self, rank: int) -> list[Move]:
        """The moves whose expert ``rank`` owns, in the order its weights are sent: by helper, then expert."""
        return sorted((m for m in self.moves if m.owner == rank), key=lambda m: (m.helper, m.expert))

    def received(self, rank: int) -> list[Move]:
        """The moves ``rank`` helps with, in the order its replicas run (local experts ``e, e+1, ...``):
        by owner, then expert (the order of the owners' sends, source-major)."""
        return sorted((m for m in self.moves if m.helper == rank), key=lambda m: (m.owner, m.expert))

    def replica_index(self, move: Move) -> int:
        """The local expert the helper runs ``move``'s rows as (``e`` + its place in :meth:`received`)."""
        return self.experts_per_rank + self.received(move.helper).index(move)

    def redirected(self, source: int, move: Move) -> tuple[int, int]:
        """``[lo, hi)``: the positions among ``source``'s own slots of ``move.expert`` (in token, k
        order) that ``move`` takes; ``hi - lo`` slots travel from ``source`` to the helper as rows of their own."""
        before = sum(self.slots_WE[s][move.expert] for s in range(source))
        mine = self.slots_WE[source][move.expert]
        lo, hi = max(move.start - before, 0), min(move.stop - before, mine)
        return (lo, hi) if lo < hi else (0, 0)

    def moves_from(self, source: int, first: int) -> list[list[int]]:
        """``[expert, lo, hi, helper, lent]`` per move that takes slots of ``source``
        (:meth:`redirected`), ``lent`` the number the helper runs the expert as (its place in
        :meth:`received`, counted from ``first``): what :func:`epmoe.ep.routing.redirected_slots` reads."""
        moves = [(m, *self.redirected(source, m)) for m in self.moves]
        lent = first - self.experts_per_rank
        return [[m.expert, lo, hi, m.helper, lent + self.replica_index(m)] for m, lo, hi in moves if lo < hi]

    def redirected_rows_W(self, source: int) -> list[int]:
        """``(W,)`` rows of their own ``source`` sends each helper (its redirected slots)."""
        rows_W = [0] * self.ep_size
        for move in self.moves:
            lo, hi = self.redirected(source, move)
            rows_W[move.helper] += hi - lo
        return rows_W

    def moved_W(self) -> list[int]:
        """``(W,)`` slots the plan moves onto (+) and off (-) each rank."""
        moved_W = [0] * self.ep_size
        for move in self.moves:
            moved_W[move.owner] -= move.slots
            moved_W[move.helper] += move.slots
        return moved_W

    def computed_rows_W(self) -> list[int]:
        """``(W,)`` slots each rank computes under the plan (its replicas' included)."""
        e = self.experts_per_rank
        routed_W = [sum(sum(row[r * e : (r + 1) * e]) for row in self.slots_WE) for r in range(self.ep_size)]
        return [a + b for a, b in zip(routed_W, self.moved_W())]

    def local_counts(self, rank: int) -> list[int]:
        """``(e + n,)`` slots each of ``rank``'s local experts computes, then each of its ``n`` replicas."""
        e = self.experts_per_rank
        counts = [sum(row[rank * e + j] for row in self.slots_WE) for j in range(e)]
        for move in self.moves:
            if move.owner == rank:
                counts[move.expert - rank * e] -= move.slots
        return counts + [move.slots for move in self.received(rank)]


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


def plan_replicas(slots_WE: list[list[int]], experts_per_rank: int, replicas: int, least: float) -> ReplicaPlan:
    """The call's plan (see the module docstring) for the slot matrix ``slots_WE`` (``W`` lists of
    ``E`` ints, identical on every rank), ``replicas`` experts per helper at most, moves of fewer
    than ``least`` slots not made (:func:`min_rows`)."""
    W, e = len(slots_WE), experts_per_rank
    load_E = [sum(column) for column in zip(*slots_WE)]
    keep_E = list(load_E)  # slots each expert's owner still computes
    load_W = [sum(load_E[r * e : (r + 1) * e]) for r in range(W)]
    target = math.ceil(sum(load_W) / W)
    helped_W = [0] * W  # replicas each rank computes
    helpers = {g: set() for g in range(len(load_E))}
    moves = []
    while True:
        owner = max(range(W), key=lambda r: (load_W[r], -r))
        room = [h for h in range(W) if h != owner and load_W[h] < target and helped_W[h] < replicas]
        if load_W[owner] <= target or not room:
            break
        helper = min(room, key=lambda h: (load_W[h], h))
        candidates = [g for g in range(owner * e, (owner + 1) * e) if keep_E[g] > 0 and helper not in helpers[g]]
        if not candidates:
            break
        expert = max(candidates, key=lambda g: (keep_E[g], -g))
        slots = min(load_W[owner] - target, target - load_W[helper], keep_E[expert])
        if slots < least:
            break
        keep_E[expert] -= slots  # the owner keeps the first slots; this move takes the ones just after
        moves.append(Move(expert, owner, helper, keep_E[expert], keep_E[expert] + slots))
        load_W[owner] -= slots
        load_W[helper] += slots
        helped_W[helper] += 1
        helpers[expert].add(helper)
    return ReplicaPlan(tuple(moves), tuple(tuple(row) for row in slots_WE), e)
