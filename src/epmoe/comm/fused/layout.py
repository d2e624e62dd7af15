"""Row orders of the fused ops as offsets: which rows go to which peer, and where they land.

A :class:`Plan` describes one exchange from one rank's point of view, in the dispatch direction's
terms (the combine direction is the same plan read backwards)::

    rank-major tensor (this rank's tokens)        expert-major tensor (this rank's experts)
    rows sorted by (r, j):                        rows sorted by (j, s):
      [->r0 j0][->r0 j1][->r1 j0][->r1 j1]          [j0 <-s0][j0 <-s1][j1 <-s0][j1 <-s1]
    counts_rank_major_WE[r*e + j]                 counts_expert_major_WE[s*e + j]
    (dispatch: send_counts; combine: recv_counts) (dispatch: recv_counts; combine: send_counts)

A pipelining round covers local experts ``[j0, j1)``. Its all-to-all moves, for every peer, the
peer's contiguous rank-major block ``(peer, j0..j1)``; on the expert-major side the round's rows
arrive source-major ``(s, j)`` and are permuted within the round to ``(j, s)``, which makes them one
contiguous slice of the expert-major tensor. With one expert per round the permutation is the
identity, so the communication itself does the permute, as in the vendor kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

Block = tuple[int, int]  # (first row, number of rows)


def round_bounds(e: int, num_chunks: int) -> list[tuple[int, int]]:
    """The rounds' local-expert ranges ``[j0, j1)``: a function of ``e`` and ``num_chunks`` only.

    ``num_chunks`` is clamped to ``e``; the ranges are contiguous and as even as possible, so every
    rank issues the same sequence of collectives whatever its token counts.
    """
    rounds = min(num_chunks, e)
    return [(c * e // rounds, (c + 1) * e // rounds) for c in range(rounds)]


def _prefix(values: list[int]) -> list[int]:
    offsets, total = [0], 0
    for value in values:
        total += value
        offsets.append(total)
    return offsets


def gather_rows(x: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """The rows of ``blocks`` of ``x``, concatenated (``x`` itself when one block covers it all)."""
    if len(blocks) == 1 and blocks[0] == (0, x.shape[0]):
        return x
    return torch.cat([x.narrow(0, start, length) for start, length in blocks])


@dataclass(frozen=True)
class Plan:
    """One rank's view of an exchange between its rank-major and its expert-major tensor.

    ``world`` ranks, ``e`` local experts per rank; both count lists have ``world * e`` entries,
    indexed ``peer * e + j``; ``rounds`` are the pipelining rounds (see :func:`round_bounds`).
    """

    world: int
    e: int
    counts_rank_major_WE: tuple[int, ...]
    counts_expert_major_WE: tuple[int, ...]
    rounds: tuple[tuple[int, int], ...]

    @functools.cached_property
    def offsets_rank_major(self) -> list[int]:
        """First row of block ``(r, j)`` of the rank-major tensor at index ``r*e + j`` (plus the end)."""
        return _prefix(list(self.counts_rank_major_WE))

    @functools.cached_property
    def group_sizes_E(self) -> list[int]:
        """Rows of local expert ``j`` in the expert-major tensor: ``sum_s counts_expert_major_WE[s*e + j]``."""
        return [sum(self.counts_expert_major_WE[s * self.e + j] for s in range(self.world)) for j in range(self.e)]

    @functools.cached_property
    def offsets_expert(self) -> list[int]:
        """First row of local expert ``j`` in the expert-major tensor (plus the end)."""
        return _prefix(self.group_sizes_E)

    @property
    def rows_rank_major(self) -> int:
        return self.offsets_rank_major[-1]

    @property
    def rows_expert_major(self) -> int:
        return self.offsets_expert[-1]

    def rank_major_blocks(self, j0: int, j1: int) -> list[Block]:
        """Per peer ``r``, the rank-major rows of experts ``[j0, j1)`` of rank ``r`` (one block each)."""
        e, offsets = self.e, self.offsets_rank_major
        return [(offsets[r * e + j0], offsets[r * e + j1] - offsets[r * e + j0]) for r in range(self.world)]

    def expert_major_splits(self, j0: int, j1: int) -> list[int]:
        """Per peer ``s``, the expert-major rows of experts ``[j0, j1)`` from (or to) ``s``."""
        e, counts = self.e, self.counts_expert_major_WE
        return [sum(counts[s * e + j0:s * e + j1]) for s in range(self.world)]

    def expert_rows(self, j0: int, j1: int) -> tuple[int, int]:
        """``(start, end)``: the expert-major slice of experts ``[j0, j1)``."""
        return self.offsets_expert[j0], self.offsets_expert[j1]

    def to_expert_major(self, j0: int, j1: int) -> list[Block]:
        """Blocks of a round buffer in ``(s, j)`` order, listed in ``(j, s)`` order (gathering permutes)."""
        source_major = self._source_major_starts(j0, j1)
        counts = self.counts_expert_major_WE
        return [(source_major[s][j - j0], counts[s * self.e + j]) for j in range(j0, j1) for s in range(self.world)]

    def to_source_major(self, j0: int, j1: int) -> list[Block]:
        """Blocks of a round slice in ``(j, s)`` order, listed in ``(s, j)`` order (the inverse permute)."""
        e, counts = self.e, self.counts_expert_major_WE
        starts, row = {}, 0
        for j in range(j0, j1):
            for s in range(self.world):
                starts[s, j] = row
                row += counts[s * e + j]
        return [(starts[s, j], counts[s * e + j]) for s in range(self.world) for j in range(j0, j1)]

    def _source_major_starts(self, j0: int, j1: int) -> list[list[int]]:
        e, counts = self.e, self.counts_expert_major_WE
        starts, row = [], 0
        for s in range(self.world):
            per_expert = []
            for j in range(j0, j1):
                per_expert.append(row)
                row += counts[s * e + j]
            starts.append(per_expert)
        return starts

    def needs_permute(self, j0: int, j1: int) -> bool:
        """Whether a round's ``(s, j)`` and ``(j, s)`` orders differ (not with one peer or one expert)."""
        return self.world > 1 and j1 - j0 > 1
