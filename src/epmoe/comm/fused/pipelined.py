"""The ``pipelined`` implementation: rounds of asynchronous all-to-all over local-expert ranges.

Dispatch (communicate, permute, compute), rounds ``c = 0..C-1`` over experts ``[j0, j1)``::

    issue a2a(0) a2a(1) ... a2a(C-1)     every round's rank-major blocks, packed per peer
    side job (shared expert)             while round 0 travels
    wait(0) permute(0) gmm(0) [dW(0)]    while rounds 1.. travel
    wait(1) permute(1) gmm(1) [dW(1)]
    ...

Combine (compute, unpermute, communicate), the mirror::

    gmm(0) unpermute(0) issue a2a(0) [dW(0)]
    gmm(1) unpermute(1) issue a2a(1) [dW(1)]   while round 0 travels
    ...
    side job (shared expert)                   hides the last round
    wait all, unpack into rank-major order

The bracketed ``dW`` is used when a pipeline runs as the other op's backward: the weight gradient
of a round is computed in the communication gap right after that round's own work. Counts are
Python lists throughout: nothing here reads a device tensor on the host.

What a run needs besides its input rows is one :class:`Run`, and it gives back one :class:`Result`:
the signatures every backend's ``dispatch`` / ``combine`` share (:mod:`~epmoe.comm.fused.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from epmoe.comm.fused.compute import SideJob
from epmoe.comm.layout import RowLayout, gather_rows, prefix
from epmoe.gmm.backend import GmmBackend
from epmoe.gmm.registry import run_grouped_mm, run_grouped_mm_backward


@dataclass(frozen=True, eq=False)
class Run:
    """One run (a forward, or a backward) besides its input rows, built by :mod:`~epmoe.comm.fused.autograd`.

    ``weight``: ``(e, D, N)``, or ``(e, N, D)`` with ``trans_weight``: this rank's experts as the run's
    grouped matmuls use them; ``gmm_backend``: the backend they run on, chosen once per call.
    ``side``: the shared expert's job, run while the pipeline communicates. With ``dw_x`` (expert-major, ``plan.rows_expert_major`` rows) the run also returns
    ``grad_weight = dW(dw_x, the run's expert-major rows)`` in the layout ``dw_trans`` says.
    ``fused_shared``: ``(shared_x, shared_weight, trans)`` for the ``npu_fused`` kernels to compute in
    place of ``side``; only that backend is given one.
    """

    plan: RowLayout
    weight: torch.Tensor
    trans_weight: bool
    group: Any
    gmm_backend: GmmBackend
    side: SideJob | None = None
    dw_x: torch.Tensor | None = None
    dw_trans: bool = False
    fused_shared: tuple[torch.Tensor, torch.Tensor, bool] | None = None


class Result(NamedTuple):
    """What a pipeline run gives back; fields not asked for are ``None``."""

    y: torch.Tensor | None
    permuted: torch.Tensor | None
    side: list[torch.Tensor] | None
    grad_weight: torch.Tensor | None


class _Exchange:
    """One round's asynchronous all-to-all-v; with one rank the "received" rows are the sent ones."""

    def __init__(self, send: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any, ep_size: int):
        if ep_size == 1:
            self.work, self._send, self.received = None, None, send
            return
        self._send = send.contiguous()
        self.received = send.new_empty((sum(output_splits), send.shape[1]))
        self.work = dist.all_to_all_single(
            self.received, self._send, output_splits, input_splits, group=group, async_op=True
        )

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work, self._send = None, None
        return self.received


def grad_weight(
    x_TD: torch.Tensor,
    dy_TN: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    trans_weight: bool,
    backend: GmmBackend,
) -> torch.Tensor:
    """``dW`` shaped like ``weight``: ``x_g^T dy_g`` per group (``dy_g^T x_g`` with ``trans_weight``),
    zero for an empty group (the grouped-matmul body's weight gradient)."""
    return run_grouped_mm_backward(dy_TN, x_TD, weight, counts, trans_weight, backend, False, True)[1]


def _fresh(pieces: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """The pieces concatenated, never a view of ``base`` (an autograd input)."""
    if len(pieces) == 1 and pieces[0]._base is None and pieces[0] is not base:
        return pieces[0]
    return torch.cat(pieces)


def dispatch(run: Run, x_rank_major: torch.Tensor, *, want_permuted: bool = False, compute_y: bool = True) -> Result:
    """All-to-all, permute to expert-major, grouped matmul; see the module docstring.

    ``x_rank_major``: ``(plan.rows_rank_major, K)``. Returns ``y`` ``(plan.rows_expert_major, N)``
    (unless ``compute_y`` is off) and, with ``want_permuted``, the received rows
    ``(plan.rows_expert_major, K)``, both expert-major. With ``run.dw_x`` it also returns
    ``grad_weight = dW(dw_x, permuted)``.
    """
    plan, weight, dw_x, backend = run.plan, run.weight, run.dw_x, run.gmm_backend
    exchanges = []
    for j0, j1 in plan.rounds:
        blocks = plan.rank_major_blocks(j0, j1)
        send = x_rank_major.narrow(0, *blocks[0]) if plan.ep_size == 1 else gather_rows(x_rank_major, blocks)
        exchanges.append(
            _Exchange(send, plan.expert_major_splits(j0, j1), [n for _, n in blocks], run.group, plan.ep_size)
        )
    side_out = run.side(None) if run.side is not None else None

    ys, permuted_rounds, dws = [], [], []
    for c, (j0, j1) in enumerate(plan.rounds):
        received = exchanges[c].wait()
        exchanges[c] = None
        permuted = gather_rows(received, plan.to_expert_major(j0, j1)) if plan.needs_permute(j0, j1) else received
        sizes = plan.rows_per_expert_e[j0:j1]
        if compute_y:
            ys.append(run_grouped_mm(permuted, weight[j0:j1], sizes, run.trans_weight, backend))
        if want_permuted:
            permuted_rounds.append(permuted)
        if dw_x is not None:
            start, end = plan.expert_rows(j0, j1)
            dws.append(grad_weight(dw_x[start:end], permuted, weight[j0:j1], sizes, run.dw_trans, backend))
    return Result(
        y=_fresh(ys, x_rank_major) if compute_y else None,
        permuted=_fresh(permuted_rounds, x_rank_major) if want_permuted else None,
        side=side_out,
        grad_weight=_fresh(dws, weight) if dw_x is not None else None,
    )


def combine(run: Run, x_expert_major: torch.Tensor, *, addend: torch.Tensor | None = None) -> Result:
    """Grouped matmul, unpermute, all-to-all back to rank-major; see the module docstring.

    ``x_expert_major``: ``(plan.rows_expert_major, K)``. Returns ``y`` ``(plan.rows_rank_major, N)``
    rank-major. ``addend`` (expert-major, ``N`` wide) is added to the grouped matmul's output before
    it is sent. With ``run.dw_x`` it also returns ``grad_weight = dW(dw_x, x_expert_major)``.
    """
    plan, weight, dw_x, backend = run.plan, run.weight, run.dw_x, run.gmm_backend
    exchanges, rank_major_splits, dws = [], [], []
    for j0, j1 in plan.rounds:
        start, end = plan.expert_rows(j0, j1)
        x_round = x_expert_major[start:end]
        sizes = plan.rows_per_expert_e[j0:j1]
        y_round = run_grouped_mm(x_round, weight[j0:j1], sizes, run.trans_weight, backend)
        if addend is not None:
            y_round = y_round + addend[start:end]
        send = gather_rows(y_round, plan.to_source_major(j0, j1)) if plan.needs_permute(j0, j1) else y_round
        splits = [n for _, n in plan.rank_major_blocks(j0, j1)]
        rank_major_splits.append(splits)
        exchanges.append(_Exchange(send, splits, plan.expert_major_splits(j0, j1), run.group, plan.ep_size))
        if dw_x is not None:
            dws.append(grad_weight(dw_x[start:end], x_round, weight[j0:j1], sizes, run.dw_trans, backend))
    side_out = run.side(None) if run.side is not None else None

    received = [exchange.wait() for exchange in exchanges]
    if len(received) == 1:
        y = received[0]
    else:  # round c holds, source rank by source rank, the rows of r's experts [j0, j1): interleave
        starts = [prefix(splits) for splits in rank_major_splits]
        y = torch.cat(
            [
                buffer.narrow(0, starts[c][r], rank_major_splits[c][r])
                for r in range(plan.ep_size)
                for c, buffer in enumerate(received)
            ]
        )
    return Result(
        y=_fresh([y], x_expert_major),
        permuted=None,
        side=side_out,
        grad_weight=_fresh(dws, weight) if dw_x is not None else None,
    )
