"""Autograd for the fused pair: the backward of each op is the other op's pipeline.

    alltoallv_gmm  forward   dispatch(x_rank_major, W)                  -> y, permuted (expert-major)
                   backward  combine(dy + dpermuted, W transposed)      -> dx (rank-major)
                             dW = permuted^T dy per expert, round by round in the communication gaps

    gmm_alltoallv  forward   combine(x_expert_major, W)                 -> y (rank-major)
                   backward  dispatch(dy, W transposed)                 -> dx (expert-major)
                             dW = x^T dG per expert (dG = dy permuted), in the communication gaps

Both directions use the same :class:`~epmoe.comm.layout.Plan`: the backward's send counts are
the forward's receive counts and vice versa. Each run (forward, backward) picks its engine on its
own (:mod:`~epmoe.comm.fused.engines`: ``npu_fused`` where every rank can run the torch_npu op,
else ``pipelined``). The shared expert's forward and backward run as the pipelines' side jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epmoe.comm.fused import npu
from epmoe.comm.fused.compute import gmm_grad_weight, shared_backward, shared_forward
from epmoe.comm.fused.engines import FusedEngine, choose_engine
from epmoe.comm.layout import Plan
from epmoe.errors import refuse_double_backward



@dataclass(frozen=True, eq=False)
class Call:
    """Everything a fused call needs besides its tensors (validated by :mod:`epmoe.comm.fused.ops`)."""

    op: str  # "alltoallv_gmm" | "gmm_alltoallv"
    plan: Plan
    group: Any
    trans_weight: bool
    trans_shared_weight: bool
    return_permuted: bool
    impl: str  # "auto" | "npu_fused" | "pipelined"
    gmm_backend: str


def _shared_side(call: Call, engine: FusedEngine, shared_x, shared_weight) -> tuple[Any, dict]:
    """The shared expert as a side job, or (fused into the NPU kernel) as the op's ``fused_shared``."""
    if shared_x is None:
        return None, {}
    trans = call.trans_shared_weight
    if engine.name == "npu_fused" and npu.fuse_shared_reason(shared_x, shared_weight, trans, call.plan.rows_rank_major) is None:
        return None, {"fused_shared": (shared_x, shared_weight, trans)}
    return shared_forward(shared_x, shared_weight, trans), {}


def _shared_grads(ctx, dshared_y, shared_x, shared_weight):
    """The shared expert's backward as a side job and a function unpacking its outputs."""
    need_x, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
    if dshared_y is None or not (need_x or need_w):
        return None, lambda outs: (None, None)
    job = shared_backward(shared_x, shared_weight, ctx.call.trans_shared_weight, dshared_y, need_x, need_w)

    def unpack(outs):
        outs = list(outs)
        return (outs.pop(0) if need_x else None), (outs.pop(0) if need_w else None)

    return job, unpack


class AlltoallvGmm(torch.autograd.Function):
    """``alltoallv_gmm``: ``(x_rank_major, weight, shared_x, shared_weight, call) -> (y, shared_y, permuted)``."""

    @staticmethod
    def forward(ctx, x_rank_major, weight, shared_x, shared_weight, call: Call):
        ctx.set_materialize_grads(False)
        ctx.call = call
        need_dw = ctx.needs_input_grad[1]
        engine = choose_engine(call, x_rank_major, weight, call.trans_weight, strict=True)
        side, fused = _shared_side(call, engine, shared_x, shared_weight)
        result = engine.dispatch(
            call.plan, x_rank_major, weight, call.trans_weight, call.group,
            gmm_backend=call.gmm_backend, side=side, want_permuted=call.return_permuted or need_dw, **fused,
        )
        ctx.rows_out, ctx.width_out = result.y.shape
        ctx.save_for_backward(result.permuted if need_dw else None, weight, shared_x, shared_weight)
        shared_y = result.side[0] if result.side is not None else None
        return result.y, shared_y, result.permuted if call.return_permuted else None

    @staticmethod
    def backward(ctx, dy_expert_major, dshared_y, dpermuted):
        refuse_double_backward("alltoallv_gmm")
        call, plan = ctx.call, ctx.call.plan
        permuted, weight, shared_x, shared_weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if dy_expert_major is None:
            dy_expert_major = weight.new_zeros(ctx.rows_out, ctx.width_out)
        side, unpack = _shared_grads(ctx, dshared_y, shared_x, shared_weight)
        dx = dw = None
        if need_dx:  # the combine pipeline carries dy (+ dpermuted) back to the senders
            unsupported = None if dpermuted is None else "the gradient of `permuted` must join before the exchange"
            engine = choose_engine(
                call, dy_expert_major, weight, not call.trans_weight, strict=False, unsupported=unsupported
            )
            result = engine.combine(
                plan, dy_expert_major, weight, not call.trans_weight, call.group,
                gmm_backend=call.gmm_backend, side=side, addend=dpermuted,
                dw_x=permuted if need_dw else None, dw_trans=call.trans_weight,
            )
            dx, dw, side_out = result.y, result.grad_weight, result.side
        else:  # no input gradient: dW is local, no communication
            if need_dw:
                dw = gmm_grad_weight(
                    permuted, dy_expert_major, weight, plan.group_sizes_E, call.trans_weight, call.gmm_backend
                )
            side_out = side(None) if side is not None else None
        dshared_x, dshared_weight = unpack(side_out) if side_out is not None else (None, None)
        return dx, dw, dshared_x, dshared_weight, None


class GmmAlltoallv(torch.autograd.Function):
    """``gmm_alltoallv``: ``(x_expert_major, weight, shared_x, shared_weight, call) -> (y, shared_y)``."""

    @staticmethod
    def forward(ctx, x_expert_major, weight, shared_x, shared_weight, call: Call):
        ctx.set_materialize_grads(False)
        ctx.call = call
        need_dw = ctx.needs_input_grad[1]
        engine = choose_engine(call, x_expert_major, weight, call.trans_weight, strict=True)
        side, fused = _shared_side(call, engine, shared_x, shared_weight)
        result = engine.combine(
            call.plan, x_expert_major, weight, call.trans_weight, call.group,
            gmm_backend=call.gmm_backend, side=side, **fused,
        )
        ctx.rows_out, ctx.width_out = result.y.shape
        ctx.save_for_backward(x_expert_major if need_dw else None, weight, shared_x, shared_weight)
        return result.y, result.side[0] if result.side is not None else None

    @staticmethod
    def backward(ctx, dy_rank_major, dshared_y):
        refuse_double_backward("gmm_alltoallv")
        call, plan = ctx.call, ctx.call.plan
        x_expert_major, weight, shared_x, shared_weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if dy_rank_major is None:
            dy_rank_major = weight.new_zeros(ctx.rows_out, ctx.width_out)
        side, unpack = _shared_grads(ctx, dshared_y, shared_x, shared_weight)
        dx = dw = None
        if need_dx or need_dw:  # both need dy in expert-major order: the dispatch pipeline brings it
            engine = choose_engine(call, dy_rank_major, weight, not call.trans_weight, strict=False)
            result = engine.dispatch(
                plan, dy_rank_major, weight, not call.trans_weight, call.group,
                gmm_backend=call.gmm_backend, side=side, compute_y=need_dx,
                dw_x=x_expert_major if need_dw else None, dw_trans=call.trans_weight,
            )
            dx, dw, side_out = result.y, result.grad_weight, result.side
        else:
            side_out = side(None) if side is not None else None
        dshared_x, dshared_weight = unpack(side_out) if side_out is not None else (None, None)
        return dx, dw, dshared_x, dshared_weight, None
