"""Error messages that stay short however large the input: lists are capped, offenders named."""

from __future__ import annotations

from collections.abc import Sequence

LIMIT = 8


def summarize(values: Sequence[int], limit: int = LIMIT) -> str:
    """``values`` in full when short, else the first ``limit`` and a summary."""
    values = list(values)
    if len(values) <= limit:
        return str(values)
    head = ", ".join(map(str, values[:limit]))
    return f"[{head}, ...] ({len(values)} values, sum {sum(values)}, min {min(values)}, max {max(values)})"


def negatives(values: Sequence[int], limit: int = LIMIT) -> str:
    """The first ``limit`` negative entries as ``index i (value)``, and how many there are."""
    bad = [(i, v) for i, v in enumerate(values) if v < 0]
    shown = ", ".join(f"index {i} ({v})" for i, v in bad[:limit])
    more = f", ... ({len(bad)} negative of {len(values)})" if len(bad) > limit else ""
    return shown + more
