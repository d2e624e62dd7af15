"""Row layouts: the only code that turns counts into splits, offsets and permutation indices.

Glossary (one letter per quantity, used in names across the package: ``x_TH``, ``send_counts_WE``...)::

    T   tokens on this rank                   K   routing choices per token (top-k)
    S   slots, S = T * K: one (token, k) pair  H   hidden size
    I   expert intermediate size              E   experts of the layer (global)
    W   ranks of the EP group (``ep_size``)   e   local experts per rank, E = W * e
    r   a destination rank, s a source rank    j   a local expert, global expert g = r*e + j
    R   rows that travel: one per (token, rank holding one of its experts); R = T on one rank
    P   pairs an expert's rank runs: one per (row, local expert among its K)

A name's suffix gives its dimensions in these letters (``x_TH`` is ``(T, H)``,
``expert_major_splits_W`` one entry per rank); ``_WE`` marks a flat list of ``W * e = E`` counts
indexed ``r*e + j`` (rank, then local expert), as ``RowLayout.counts_rank_major_WE``.

(The grouped matmul, below this package, names its own operands: ``x (T, D)`` rows by group,
``weight (G, D, N)``, ``G`` groups, ``D`` the contracted width.)

Words, one meaning each::

    route        the model's router picks K experts per token (epmoe never changes it)
    exchange     an all-to-all: of counts (the counts exchange, ``exchange_counts``), of step
                 headers (:mod:`epmoe.comm.steps`), or of rows
    dispatch     tokens to their experts' ranks; combine: their outputs back
    transport    how dispatch and combine move rows: all-to-all-v, one row per (token, rank)
                 (:mod:`epmoe.ep.routing`), or the fused ops, one row per slot in the three orders
                 below (the config's ``dispatch`` field names it; :mod:`epmoe.ep.dispatch`)
    layout       where each per-slot row sits in the three orders below (:class:`RowLayout`)
    shard        what one EP rank holds of an experts module (``ExpertShard``); checkpoints have files
    group        a ``torch.distributed`` process group (the grouped matmul's row groups are ``G``)
    backend      an implementation chosen by eligibility, with a reason when it declines: grouped-matmul
                 backends, and the fused ops' backends (their public ``impl=`` argument)
    agreement    one step in which every rank shows its peers what must match, before anything changes
                 (:meth:`epmoe.comm.steps.StepChannel.agree`)
    header       a step header: one int64 row to each peer saying where the sender is (layer, phase,
                 call); a step channel is one group's header exchanges (:mod:`epmoe.comm.steps`)
    round        a pipelining round of the fused ops: local experts ``[j0, j1)``, one all-to-all

Three orders of per-slot rows (the fused ops' layout, the vendor's), for one layer on one rank::

    rank-major (sender)            source-major (receiver)        expert-major (receiver)
    rows sorted by g = (r, j)      rows by (s, j) as received     rows by (j, s): grouped_mm input
    +--------+                     +-----------+                  +-----------+
    | ->0,j0 |  --all-to-all-v-->  | s0 -> j0  |  --permute--->   | j0 <- s0  |
    | ->0,j1 |                     | s0 -> j1  |                  | j0 <- s1  |
    | ->1,j0 |                     | s1 -> j0  |                  | j1 <- s0  |
    | ->1,j1 |                     | s1 -> j1  |                  | j1 <- s1  |
    +--------+                     +-----------+                  +-----------+
    counts_rank_major_WE[r*e + j]  counts_expert_major_WE[s*e + j] (the same counts, read (j, s))

A :class:`RowLayout` describes one exchange of rows from one rank's point of view, in the dispatch direction's
terms (the combine direction is the same plan read backwards: dispatch sends ``counts_rank_major``
and receives ``counts_expert_major``, combine the reverse).

A pipelining round covers local experts ``[j0, j1)``. Its all-to-all moves, for every peer, the
peer's contiguous rank-major block ``(peer, j0..j1)``; on the expert-major side the round's rows
arrive source-major ``(s, j)`` and are permuted within the round to ``(j, s)``, which makes them one
contiguous slice of the expert-major tensor. With one expert per round the permutation is the
identity, so the communication itself does the permute, as in the vendor kernel. The all-to-all-v
exchange is the one round ``[0, e)``.

(The grouped matmul's own per-group offsets, an argument of its kernels, stay with the grouped
matmul backends: :mod:`epmoe.gmm` sits below this package.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from epmoe.gmm.backend import prefix

Block = tuple[int, int]  # (first row, number of rows)


def round_bounds(e: int, num_chunks: int) -> list[tuple[int, int]]:
    """The rounds' local-expert ranges ``[j0, j1)``: a function of ``e`` and ``num_chunks`` only.

    ``num_chunks`` is clamped to ``e``; the ranges are contiguous and as even as possible, so every
    rank issues the same sequence of collectives whatever its token counts.
    """
    rounds = min(num_chunks, e)
    return [(c * e // rounds, (c + 1) * e // rounds) for c in range(rounds)]


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``x[index][inverse] == x`` for a permutation ``index`` (one scatter, on its device)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


def rows_index(blocks: list[Block], total: int) -> torch.Tensor:
    """The host index ``idx`` with ``x[idx]`` = the rows of ``blocks`` of ``x``, in that order
    (``total`` rows in all); built in a few tensor operations, not one ``arange`` per block."""
    if not blocks:
        return torch.zeros(0, dtype=torch.int64)
    starts, lengths = (torch.tensor(column, dtype=torch.int64) for column in zip(*blocks))
    out_starts = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - out_starts, lengths, output_size=total) + torch.arange(total)


def gather_rows(x: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """The rows of ``blocks`` of ``x``, concatenated (``x`` itself when one block covers it all)."""
    if len(blocks) == 1 and blocks[0] == (0, x.shape[0]):
        return x
    return torch.cat([x.narrow(0, start, length) for start, length in blocks])


@dataclass(frozen=True)
class RowLayout:
    """One rank's view of an exchange between its rank-major and its expert-major tensor.

    ``ep_size`` ranks, ``e`` local experts per rank; both count lists have ``ep_size * e`` entries,
    indexed ``peer * e + j``; ``rounds`` are the pipelining rounds (see :func:`round_bounds`).
    """

    ep_size: int
    e: int
    counts_rank_major_WE: tuple[int, ...]
    counts_expert_major_WE: tuple[int, ...]
    rounds: tuple[tuple[int, int], ...]

    @functools.cached_property
    def offsets_rank_major(self) -> list[int]:
        """First row of block ``(r, j)`` of the rank-major tensor at index ``r*e + j`` (plus the end)."""
        return prefix(list(self.counts_rank_major_WE))

    @functools.cached_property
    def rows_per_expert_e(self) -> list[int]:
        """Rows of local expert ``j`` in the expert-major tensor: ``sum_s counts_expert_major_WE[s*e + j]``."""
        return [sum(self.counts_expert_major_WE[s * self.e + j] for s in range(self.ep_size)) for j in range(self.e)]

    @functools.cached_property
    def offsets_expert(self) -> list[int]:
        """First row of local expert ``j`` in the expert-major tensor (plus the end)."""
        return prefix(self.rows_per_expert_e)

    @property
    def rows_rank_major(self) -> int:
        return self.offsets_rank_major[-1]

    @property
    def rows_expert_major(self) -> int:
        return self.offsets_expert[-1]

    @classmethod
    def one_round(cls, ep_size: int, e: int, counts_rank_major_WE, counts_expert_major_WE) -> RowLayout:
        """The all-to-all-v exchange: one round over all ``e`` local experts."""
        return cls(ep_size, e, tuple(counts_rank_major_WE), tuple(counts_expert_major_WE), ((0, e),))

    @property
    def rank_major_splits(self) -> list[int]:
        """Rows per peer of the rank-major tensor, all local experts."""
        return [rows for _, rows in self.rank_major_blocks(0, self.e)]

    @property
    def expert_major_splits_W(self) -> list[int]:
        """Rows per peer of the expert-major tensor, all local experts."""
        return self.expert_major_splits(0, self.e)

    def rank_major_blocks(self, j0: int, j1: int) -> list[Block]:
        """Per peer ``r``, the rank-major rows of experts ``[j0, j1)`` of rank ``r`` (one block each)."""
        e, offsets = self.e, self.offsets_rank_major
        return [(offsets[r * e + j0], offsets[r * e + j1] - offsets[r * e + j0]) for r in range(self.ep_size)]

    def expert_major_splits(self, j0: int, j1: int) -> list[int]:
        """Per peer ``s``, the expert-major rows of experts ``[j0, j1)`` from (or to) ``s``."""
        e, counts = self.e, self.counts_expert_major_WE
        return [sum(counts[s * e + j0 : s * e + j1]) for s in range(self.ep_size)]

    def expert_rows(self, j0: int, j1: int) -> tuple[int, int]:
        """``(start, end)``: the expert-major slice of experts ``[j0, j1)``."""
        return self.offsets_expert[j0], self.offsets_expert[j1]

    def to_expert_major(self, j0: int, j1: int) -> list[Block]:
        """Blocks of a round buffer in ``(s, j)`` order, listed in ``(j, s)`` order (gathering permutes)."""
        source_major = self._source_major_starts(j0, j1)
        counts = self.counts_expert_major_WE
        return [(source_major[s][j - j0], counts[s * self.e + j]) for j in range(j0, j1) for s in range(self.ep_size)]

    def to_source_major(self, j0: int, j1: int) -> list[Block]:
        """Blocks of a round slice in ``(j, s)`` order, listed in ``(s, j)`` order (the inverse permute)."""
        e, counts = self.e, self.counts_expert_major_WE
        starts, row = {}, 0
        for j in range(j0, j1):
            for s in range(self.ep_size):
                starts[s, j] = row
                row += counts[s * e + j]
        return [(starts[s, j], counts[s * e + j]) for s in range(self.ep_size) for j in range(j0, j1)]

    def _source_major_starts(self, j0: int, j1: int) -> list[list[int]]:
        e, counts = self.e, self.counts_expert_major_WE
        starts, row = [], 0
        for s in range(self.ep_size):
            per_expert = []
            for j in range(j0, j1):
                per_expert.append(row)
                row += counts[s * e + j]
            starts.append(per_expert)
        return starts

    def needs_permute(self, j0: int, j1: int) -> bool:
        """Whether a round's ``(s, j)`` and ``(j, s)`` orders differ (not with one peer or one expert)."""
        return self.ep_size > 1 and j1 - j0 > 1
