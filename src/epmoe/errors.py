"""What the engine's errors share: messages that stay short however large the input (lists
capped, offenders named), and the refusal of double backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def refuse_double_backward(op: str) -> None:
    """Raise inside a backward run with ``create_graph=True``: epmoe's backward exchanges and kernels
    are not themselves differentiable, so a second-order gradient would silently miss their terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"epmoe {op}: double backward (backward with create_graph=True, e.g. a gradient penalty) is not "
            f"supported: its backward is not differentiable. Compute second-order terms without EP "
            f"(apply_expert_parallel on a group of one still differentiates once only), or use "
            f"torch.func on the unsharded model"
        )
