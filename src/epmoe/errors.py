"""What the engine's errors and log lines share: messages that stay short however large the input
(lists capped, offenders named), log lines said once per process, and the refusal of double
backward."""

from __future__ import annotations

import logging
import operator
from collections.abc import Hashable, Sequence

import torch

LIMIT = 8
_said: set[Hashable] = set()


def log_once(logger: logging.Logger, level: int, key: Hashable, message: str, *args) -> None:
    """``logger.log(level, message, *args)`` the first time ``key`` is seen in this process. No lock
    (set membership is atomic under the GIL; two threads may both say it once), so it is safe on
    paths ``torch.compile`` traces."""
    if key in _said:
        return
    _said.add(key)
    logger.log(level, message, *args)


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


def int_list(where: str, counts: object, *, host_only: bool = False) -> list[int]:
    """``counts`` (a sequence of ints, or a 1-D integer tensor) as a Python list, for every function
    taking counts (``where``: ``"caller(argument)"``). ``TypeError`` for anything else (floats,
    bools, strings); ``ValueError`` for a tensor that is not 1-D or has no values (meta). With
    ``host_only``, a tensor off the CPU is refused too (reading it would synchronise the host);
    otherwise it is read once."""
    if isinstance(counts, torch.Tensor):
        check_counts_tensor(where, counts, host_only=host_only)
        return counts.tolist()
    if not isinstance(counts, Sequence) or isinstance(counts, (str, bytes)):
        raise TypeError(f"{where}: expected a sequence of ints or an integer tensor, got {type(counts).__name__}")
    values = []
    for c in counts:
        try:
            if isinstance(c, bool):
                raise TypeError
            values.append(operator.index(c))
        except TypeError:
            raise TypeError(f"{where}: expected ints, got {c!r} ({type(c).__name__})") from None
    return values


def check_counts_tensor(where: str, counts: torch.Tensor, *, host_only: bool = False) -> None:
    """What :func:`int_list` requires of a counts tensor, checked without reading it (``torch.compile``
    traces this): an integer dtype (``TypeError``), 1-D (``ValueError``), on the CPU where
    ``host_only`` (``TypeError``), not on the meta device (``ValueError``)."""
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"{where}: expected an integer tensor, got {counts.dtype}")
    if counts.dim() != 1:
        raise ValueError(f"{where}: expected a 1-D tensor, got shape {tuple(counts.shape)}")
    if host_only and counts.device.type != "cpu":
        raise TypeError(
            f"{where}: a tensor on {counts.device}; pass Python lists (epmoe.exchange_counts returns "
            f"them), reading a device tensor would synchronise the host"
        )
    if counts.device.type == "meta":
        raise ValueError(
            f"{where}: the tensor is on the meta device and has no values; pass real counts (a "
            f"list, or a tensor on a real device)"
        )


def double_backward_error(op: str) -> RuntimeError:
    """What a backward of ``op`` raises when run with ``create_graph=True`` (gradients enabled inside
    it: ``if torch.is_grad_enabled(): raise double_backward_error(op)``): epmoe's backward exchanges
    and kernels are not themselves differentiable, so a second-order gradient would silently miss
    their terms."""
    return RuntimeError(
        f"epmoe {op}: double backward (backward with create_graph=True, e.g. a gradient penalty) is not "
        f"supported: its backward is not differentiable. Compute second-order terms without EP "
        f"(apply_expert_parallel on a group of one still differentiates once only), or use "
        f"torch.func on the unsharded model"
    )
