"""Autograd for the fused pair: the backward of each op is the other op's pipeline.

    alltoallv_gmm  forward   dispatch(x_rank_major, W)                  -> y, permuted (expert-major)
                   backward  combine(dy + dpermuted, W transposed)      -> dx (rank-major)
                             dW = permuted^T dy per expert, round by round in the communication gaps

    gmm_alltoallv  forward   combine(x_expert_major, W)                 -> y (rank-major)
                   backward  dispatch(dy, W transposed)                 -> dx (expert-major)
                             dW = x^T dG per expert (dG = dy permuted), in the communication gaps

Both directions use the same :class:`~epmoe.comm.layout.RowLayout`: the backward's send counts are
the forward's receive counts and vice versa. Each run (forward, backward) picks its backend on its
own (:mod:`~epmoe.comm.fused.backends`: ``npu_fused`` where every rank can run the torch_npu op,
else ``pipelined``) and hands it one :class:`~epmoe.comm.fused.pipelined.Run`. The shared expert's
forward and backward run as the pipelines' side jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epmoe.comm.fused import npu
from epmoe.comm.fused.backends import FusedBackend, choose_fused_backend
from epmoe.comm.fused.compute import shared_backward, shared_forward
from epmoe.comm.fused.pipelined import Result, Run, grad_weight
from epmoe.comm.layout import RowLayout
from epmoe.errors import double_backward_error
from epmoe.gmm.backend import GmmBackend


@dataclass(frozen=True, eq=False)
class Call:
    """Everything a fused call needs besides its tensors (validated by :mod:`epmoe.comm.fused.ops`)."""

    op: str  # "alltoallv_gmm" | "gmm_alltoallv"
    plan: RowLayout
    group: Any
    trans_weight: bool
    trans_shared_weight: bool
    return_permuted: bool
    impl: str  # "auto" | "npu_fused" | "pipelined"
    gmm_backend: GmmBackend  # chosen once per call: every grouped matmul of its forward and backward


def _start_forward(
    ctx, call: Call, x: torch.Tensor, weight: torch.Tensor, shared_x, shared_weight
) -> tuple[FusedBackend, Run]:
    """The forwards' common start: ``(backend, run)`` for this run, the shared expert as the run's side
    job, or fused into the NPU kernel as its ``fused_shared``."""
    ctx.set_materialize_grads(False)
    ctx.call = call
    backend = choose_fused_backend(call, x, weight, call.trans_weight, strict=True)
    side = fused_shared = None
    if shared_x is not None:
        trans, rows = call.trans_shared_weight, call.plan.rows_rank_major
        if backend.name == "npu_fused" and npu.fuse_shared_reason(shared_x, shared_weight, trans, rows) is None:
            fused_shared = (shared_x, shared_weight, trans)
        else:
            side = shared_forward(shared_x, shared_weight, trans)
    return backend, Run(
        call.plan, weight, call.trans_weight, call.group, call.gmm_backend, side, fused_shared=fused_shared
    )


def _finish_forward(ctx, result: Result, dw_x: torch.Tensor, weight, shared_x, shared_weight) -> torch.Tensor | None:
    """Save what the backward needs (``dw_x``, the rows ``dW`` is computed from, only if the weight
    needs a gradient); returns ``shared_y`` or ``None``."""
    ctx.rows_out, ctx.width_out = result.y.shape
    ctx.save_for_backward(dw_x if ctx.needs_input_grad[1] else None, weight, shared_x, shared_weight)
    return result.side[0] if result.side is not None else None


def _start_backward(ctx, op: str, dy: torch.Tensor | None, dshared_y) -> tuple[torch.Tensor, Run]:
    """The backwards' common start: ``dy`` (zeros where it is missing) and the run of the other op's
    pipeline with the weight transposed, ``dw_x`` where the weight needs a gradient and the shared
    expert's backward as its side job."""
    if torch.is_grad_enabled():
        raise double_backward_error(op)
    call = ctx.call
    dw_x, weight, shared_x, shared_weight = ctx.saved_tensors
    if dy is None:
        dy = weight.new_zeros(ctx.rows_out, ctx.width_out)
    need_x, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
    side = None
    if dshared_y is not None and (need_x or need_w):
        side = shared_backward(shared_x, shared_weight, call.trans_shared_weight, dshared_y, need_x, need_w)
    return dy, Run(
        call.plan,
        weight,
        not call.trans_weight,
        call.group,
        call.gmm_backend,
        side,
        dw_x=dw_x,
        dw_trans=call.trans_weight,
    )


def _finish_backward(ctx, dx, dw, side_out: list[torch.Tensor] | None) -> tuple:
    """The Function's five gradients, the shared expert's unpacked from its side job's outputs."""
    if side_out is None:
        return dx, dw, None, None, None
    outs = iter(side_out)  # [dshared_x][, dshared_weight]: whichever is needed
    dshared_x = next(outs) if ctx.needs_input_grad[2] else None
    dshared_weight = next(outs) if ctx.needs_input_grad[3] else None
    return dx, dw, dshared_x, dshared_weight, None


def _side_inline(run: Run) -> list[torch.Tensor] | None:
    """The side job's outputs, run inline where no pipeline runs."""
    return run.side(None) if run.side is not None else None


class AlltoallvGmm(torch.autograd.Function):
    """``alltoallv_gmm``: ``(x_rank_major, weight, shared_x, shared_weight, call) -> (y, shared_y, permuted)``."""

    @staticmethod
    def forward(ctx, x_rank_major, weight, shared_x, shared_weight, call: Call):
        backend, run = _start_forward(ctx, call, x_rank_major, weight, shared_x, shared_weight)
        result = backend.dispatch(run, x_rank_major, want_permuted=call.return_permuted or ctx.needs_input_grad[1])
        shared_y = _finish_forward(ctx, result, result.permuted, weight, shared_x, shared_weight)
        return result.y, shared_y, result.permuted if call.return_permuted else None

    @staticmethod
    def backward(ctx, dy_expert_major, dshared_y, dpermuted):
        dy_expert_major, run = _start_backward(ctx, "alltoallv_gmm", dy_expert_major, dshared_y)
        if ctx.needs_input_grad[0]:  # the combine pipeline carries dy (+ dpermuted) back to the senders
            unsupported = None if dpermuted is None else "the gradient of `permuted` must join before the exchange"
            backend = choose_fused_backend(
                ctx.call, dy_expert_major, run.weight, run.trans_weight, strict=False, unsupported=unsupported
            )
            result = backend.combine(run, dy_expert_major, addend=dpermuted)
            return _finish_backward(ctx, result.y, result.grad_weight, result.side)
        dw = None  # no input gradient: dW is local, no communication
        if run.dw_x is not None:  # the saved permuted rows
            dw = grad_weight(
                run.dw_x, dy_expert_major, run.weight, run.plan.rows_per_expert_e, run.dw_trans, run.gmm_backend
            )
        return _finish_backward(ctx, None, dw, _side_inline(run))


class GmmAlltoallv(torch.autograd.Function):
    """``gmm_alltoallv``: ``(x_expert_major, weight, shared_x, shared_weight, call) -> (y, shared_y)``."""

    @staticmethod
    def forward(ctx, x_expert_major, weight, shared_x, shared_weight, call: Call):
        backend, run = _start_forward(ctx, call, x_expert_major, weight, shared_x, shared_weight)
        result = backend.combine(run, x_expert_major)
        return result.y, _finish_forward(ctx, result, x_expert_major, weight, shared_x, shared_weight)

    @staticmethod
    def backward(ctx, dy_rank_major, dshared_y):
        dy_rank_major, run = _start_backward(ctx, "gmm_alltoallv", dy_rank_major, dshared_y)
        need_dx = ctx.needs_input_grad[0]
        if need_dx or run.dw_x is not None:  # both need dy in expert-major order: the dispatch pipeline brings it
            backend = choose_fused_backend(ctx.call, dy_rank_major, run.weight, run.trans_weight, strict=False)
            result = backend.dispatch(run, dy_rank_major, compute_y=need_dx)
            return _finish_backward(ctx, result.y, result.grad_weight, result.side)
        return _finish_backward(ctx, None, None, _side_inline(run))
