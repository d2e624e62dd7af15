"""The local experts' MLP on a layer's rows, keeping little for backward: ``epmoe::routed_mlp``.

One op runs what an expert's rank computes for the rows it holds (:mod:`epmoe.ep.routing`: rows,
and the pairs they expand to)::

    x_RH --gather by slot_P // K--> x_PH --grouped_mm(up)--> h_PN --gate--> a_PI --grouped_mm(down)--> y_PH
         --weighted by weights_RK, summed over each row's pairs in k order--> out_RH

For backward it keeps the rows ``x_RH`` (on one rank, the block input itself, which the router keeps
too), the up projection's output ``h_PN`` (``N = 2I`` for gated experts) and the routing indices and
weights: about ``H + 2KI`` elements per token, SonicMoE's bound, against ``K(2H + 4I)`` for plain
autograd. Everything else is recomputed in backward by index (the gathered rows, each row's
gradient) or elementwise (the gate); the routing weights' gradient needs no expert output::

    out_r = sum_k w_rk y_rk,   y = a @ Wd (+ b)   =>   d w_rk = <d out_r, y_rk> = <d out_r @ Wd^T, a_rk> (+ <d out_r, b>)

and ``d out_r @ Wd^T`` is the down projection's input gradient before weighting, which backward
computes anyway: no matmul is added. The sums are in a fixed order (deterministic run to run).

What an expert computes on its rows, up -> gate -> down (+ biases), is written once,
:func:`expert_mlp`, over a grouped-matmul callable: the op runs it on the one grouped-matmul body of
:mod:`epmoe.gmm.registry`, and the plain-autograd path (:meth:`~epmoe.ep.experts.LocalExperts.forward`)
on :func:`epmoe.grouped_mm`. The fused transport splits the same pieces across its two ops: the up
projection inside ``alltoallv_gmm``, :meth:`~epmoe.ep.experts.LocalExperts.gate_activation` between
them, the down projection inside ``gmm_alltoallv``, both on the same grouped-matmul body (the fused
ops take no biases). All of them run the backend the experts module chose once
(:meth:`~epmoe.ep.experts.LocalExperts.gmm_backend`); the op asks its experts module for it when it
runs, so ``torch.compile`` traces nothing of the choice.

The op is a ``torch.library`` custom op with a custom backward op: ``torch.compile`` traces it as one
call. The gate is recomputed in backward (:meth:`~epmoe.ep.experts.LocalExperts.gate_vjp`: a SiLU
gate's derivative written out, any other gate of the experts' own, transformers' ``_apply_gate`` /
``act_fn``, through ``torch.func.vjp``; on an NPU the forward may run ``npu_swiglu``, the recompute
the same function in plain torch ops). Experts it cannot run (an expert's own forward, a norm after the down
projection) run :func:`routed_mlp_autograd`: the same result through plain autograd.

*Padded pairs* (:func:`epmoe.ep.routing.pair_rows` with ``padded``: the static transport, whose
number of pairs is known on the device only): ``P = R * K``, the real pairs first, then padding,
which the grouped matmuls leave out (their output rows past the counts' sum are uninitialised,
possibly NaN: masked with ``masked_fill``, never multiplied by zero). A padding pair's up
projection output is zero, its weight is zero, its output is never read (``pair_RK`` points past
``P``) and its gradients are zero: it contributes nothing forward or backward.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import torch

from epmoe import platform
from epmoe.ep.routing import ACCUMULATION_DTYPES, RowPairs
from epmoe.errors import double_backward_error
from epmoe.gmm.operands import counts_once
from epmoe.gmm.registry import run_grouped_mm, run_grouped_mm_backward

# a grouped matmul with its counts and backend bound: (x_AD rows grouped by local expert, weight) -> y_AN
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_LIVE: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # key -> LocalExperts
_KEYS = itertools.count()


def register_experts(experts: object) -> int:
    """A key by which the op finds ``experts`` (a :class:`~epmoe.ep.experts.LocalExperts`, for its
    gate and its grouped-matmul backend): custom ops take no Python objects."""
    key = next(_KEYS)
    _LIVE[key] = experts
    return key


def expert_mlp(
    x_AH: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    gate: Callable[[torch.Tensor], torch.Tensor],
    matmul: GroupedMatmul,
    padding_A: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h_AN, y_AH)``: the local experts' MLP on rows grouped by local expert, ``counts[j]`` rows
    for expert ``j`` (``x_AH``, rows expert-major)::

        h = matmul(x, up)          (+ up_bias of each row's expert)
        y = matmul(gate(h), down)  (+ down_bias of its expert)

    ``up``, ``down``: the experts' weights as ``matmul`` reads them; ``gate``: the experts' gate /
    activation (:meth:`~epmoe.ep.experts.LocalExperts.gate_activation`); ``padding_A``: ``(A,)``
    bool, the rows past the counts' sum (padded pairs: ``h`` there is zero, ``y`` undefined). The
    one place the experts' MLP is written (see the module docstring); the fused transport runs its
    projections inside its ops, on the same grouped-matmul body, and takes no biases
    (:func:`~epmoe.ep.recognize.fused_ineligible_reason`)."""
    expert_A = None
    if up_bias is not None or down_bias is not None:  # each row's expert, for its bias
        expert_A = expert_of_rows(counts, x_AH.shape[0], x_AH.device, padded=padding_A is not None)
    h_AN = matmul(x_AH, up)
    if up_bias is not None:
        h_AN = h_AN + up_bias[expert_A]
    if padding_A is not None:
        h_AN = h_AN.masked_fill(padding_A.unsqueeze(1), 0)
    y_AH = matmul(gate(h_AN), down)
    return h_AN, y_AH if down_bias is None else y_AH + down_bias[expert_A]


def expert_of_rows(
    counts: Sequence[int] | torch.Tensor, num_rows: int, device: torch.device, *, padded: bool = False
) -> torch.Tensor:
    """``(A,)``: each row's local expert, for rows grouped by expert (``counts[j]`` rows for expert
    ``j``); built where the counts are (host counts: on the host, then copied), its gather's
    backward an index_put. ``padded``: the rows past the counts' sum are padding (given the last
    expert; their values are masked by the caller), found on the device by a sorted search."""
    counts_e = torch.as_tensor(counts)
    experts = torch.arange(counts_e.numel(), device=counts_e.device)
    if padded:
        ends_e = counts_e.cumsum(0)
        rows_A = torch.arange(num_rows, device=counts_e.device)
        expert_A = torch.searchsorted(ends_e, rows_A, right=True).clamp_(max=counts_e.numel() - 1)
        return platform.host_to_device(expert_A, device)
    return platform.host_to_device(torch.repeat_interleave(experts, counts_e, output_size=num_rows), device)


def weighted_sum(
    y_PH: torch.Tensor,
    weights_RK: torch.Tensor | None,
    pair_RK: torch.Tensor,
    out_dtype: torch.dtype,
    padded: bool = False,
) -> torch.Tensor:
    """``(R, H)``: each row's pairs' outputs times their weights (``None``: unweighted), summed in ``k``
    order in float32 or wider (as ``torch.sum`` accumulates 16-bit floats); rows without a pair at
    some ``k`` (``pair_RK == P``) take a zero row there (``padded``: ``P = R * K`` and some may have
    none). Differentiable, and connected to ``y_PH`` and ``weights_RK`` even without pairs (a rank's
    backward exchanges must run)."""
    R, K = pair_RK.shape
    P, H = y_PH.shape
    product_dtype = y_PH.dtype if weights_RK is None else torch.promote_types(y_PH.dtype, weights_RK.dtype)
    sum_dtype = ACCUMULATION_DTYPES.get(product_dtype, product_dtype)
    if P == 0:  # sums of nothing, to stay connected
        connected = y_PH.sum() if weights_RK is None else y_PH.sum() + weights_RK[:0].sum()
        return (y_PH.new_zeros(R, H, dtype=sum_dtype) + connected).to(out_dtype)
    if P < R * K or padded:  # some (row, k) have no pair: they read an appended zero row
        y_PH = torch.cat([y_PH, y_PH.new_zeros(1, H)])
    # padded, P = R * K: one gather of every (row, k), no larger than y_PH (the same sums)
    y_RKH = y_PH[pair_RK] if padded else None
    out_RH = None
    for k in range(K):
        y_RH = y_RKH[:, k] if padded else y_PH[pair_RK[:, k]]
        if weights_RK is None:
            out_RH = y_RH.to(sum_dtype).contiguous() if out_RH is None else out_RH.add_(y_RH)
        elif out_RH is None:
            out_RH = (y_RH * weights_RK[:, k : k + 1]).to(sum_dtype)
        else:
            out_RH.addcmul_(y_RH, weights_RK[:, k : k + 1])
    return out_RH.to(out_dtype)


def _routed_mlp(
    x_RH: torch.Tensor,
    weights_RK: torch.Tensor,
    slot_P: torch.Tensor,
    pair_RK: torch.Tensor,
    counts_e: torch.Tensor,
    host_counts: list[int] | None,
    up: torch.Tensor,
    down: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    trans_weight: bool,
    experts_key: int,
    differentiable: bool,
    padded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_RH, h_PN)``: the rows' routed MLP and the up projection's output (kept for backward);
    ``padded``: the pairs are padded (see the module docstring)."""
    K = weights_RK.shape[1]
    experts = _LIVE[experts_key]
    backend = experts.gmm_backend(up, down, counts=host_counts, backward=differentiable)
    counts = host_counts if host_counts is not None else counts_once(backend, counts_e, up.shape[0], x_RH.device)
    h_PN, y_PH = expert_mlp(
        x_RH[slot_P // K],
        counts_e,
        up,
        down,
        up_bias,
        down_bias,
        experts.gate_activation,
        lambda x, w: run_grouped_mm(x, w, counts, trans_weight, backend),
        _padding(counts_e, slot_P.numel()) if padded else None,
    )
    return weighted_sum(y_PH, weights_RK, pair_RK, x_RH.dtype, padded), h_PN


_routed_mlp_op = torch.library.custom_op("epmoe::routed_mlp", _routed_mlp, mutates_args=())


def _padding(counts_e: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """``(P,)`` bool on the device: the padded pairs, past the counts' sum."""
    return torch.arange(num_pairs, device=counts_e.device) >= counts_e.sum()


@_routed_mlp_op.register_fake
def _routed_mlp_fake(
    x_RH,
    weights_RK,
    slot_P,
    pair_RK,
    counts_e,
    host_counts,
    up,
    down,
    up_bias,
    down_bias,
    trans_weight,
    experts_key,
    differentiable,
    padded,
):
    return torch.empty_like(x_RH), x_RH.new_empty(slot_P.shape[0], up.shape[1 if trans_weight else 2])


@torch.library.custom_op("epmoe::routed_mlp_backward", mutates_args=())
def _routed_mlp_backward_op(
    dout_RH: torch.Tensor,
    x_RH: torch.Tensor,
    h_PN: torch.Tensor,
    weights_RK: torch.Tensor,
    slot_P: torch.Tensor,
    pair_RK: torch.Tensor,
    counts_e: torch.Tensor,
    host_counts: list[int] | None,
    up: torch.Tensor,
    down: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    trans_weight: bool,
    experts_key: int,
    padded: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx_RH, dweights_RK, d_up, d_down, d_up_bias, d_down_bias)`` (empty where there is no bias);
    padded pairs (``padded``) get zero gradients (the matmuls' rows for them are masked)."""
    K, P = weights_RK.shape[1], slot_P.numel()
    experts = _LIVE[experts_key]
    row_P = slot_P // K
    backend = experts.gmm_backend(up, down, counts=host_counts, backward=True)  # the forward's
    counts = host_counts if host_counts is not None else counts_once(backend, counts_e, up.shape[0], dout_RH.device)
    expert_P = expert_of_rows(counts_e, P, dout_RH.device, padded=padded) if up_bias is not None else None
    a_PI, gate_vjp = experts.gate_vjp(h_PN)  # the gate recomputed from h (elementwise), and its vjp
    dout_PH = dout_RH[row_P]
    w_P = weights_RK.reshape(-1)[slot_P]
    padding_P = _padding(counts_e, P).unsqueeze(1) if padded else None
    if padded:
        w_P = w_P.masked_fill(padding_P.squeeze(1), 0)
    # down projection: u = d out @ Wd^T (the input gradient before weighting) serves both the
    # activation's gradient (w * u) and the routing weight's (<u, a>)
    no_x = a_PI.new_empty(0, a_PI.shape[1])
    u_PI, _ = run_grouped_mm_backward(dout_PH, no_x, down, counts, trans_weight, backend, True, False)
    if padded:  # rows past the counts' sum: uninitialised
        u_PI = u_PI.masked_fill_(padding_P, 0)
    product_dtype = torch.promote_types(dout_RH.dtype, weights_RK.dtype)
    sum_dtype = ACCUMULATION_DTYPES.get(product_dtype, product_dtype)
    dw_P = _row_dots(u_PI, a_PI, sum_dtype)
    if down_bias is not None:
        dw_P = dw_P + _row_dots(dout_PH, down_bias[expert_P], sum_dtype)
        if padded:  # a padding pair's bias term: its weight's gradient is zero
            dw_P = dw_P.masked_fill(padding_P.squeeze(1), 0)
    dy_PH = dout_PH.mul_(w_P.unsqueeze(1))  # the down projection's output gradient, in dout_PH's storage
    _, d_down = run_grouped_mm_backward(dy_PH, a_PI.contiguous(), down, counts, trans_weight, backend, False, True)
    d_down_bias, d_up_bias = x_RH.new_empty(0), x_RH.new_empty(0)
    if down_bias is not None:
        d_down_bias = torch.zeros_like(down_bias).index_put_((expert_P,), dy_PH, accumulate=True)
    del dout_PH, dy_PH, a_PI  # each (P, .) buffer goes once read for the last time: the peak holds fewer
    dh_PN = gate_vjp(u_PI.mul_(w_P.unsqueeze(1))).contiguous()  # d a = w * u, in u's storage
    del u_PI, gate_vjp
    if up_bias is not None:
        d_up_bias = torch.zeros_like(up_bias).index_put_((expert_P,), dh_PN, accumulate=True)
    dx_PH, d_up = run_grouped_mm_backward(dh_PN, x_RH[row_P], up, counts, trans_weight, backend, True, True)
    del dh_PN
    dx_RH = weighted_sum(dx_PH, None, pair_RK, x_RH.dtype, padded)
    dweights_RK = torch.zeros(weights_RK.numel(), dtype=weights_RK.dtype, device=weights_RK.device)
    dweights_RK.index_copy_(0, slot_P, dw_P.to(weights_RK.dtype))
    return dx_RH, dweights_RK.view_as(weights_RK), d_up, d_down, d_up_bias, d_down_bias


def _row_dots(a_PN: torch.Tensor, b_PN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(P,)``: each row's dot product, in ``dtype`` (the inputs' own where it is theirs: no
    ``(P, N)`` product is written)."""
    if a_PN.dtype == b_PN.dtype == dtype:
        return torch.linalg.vecdot(a_PN, b_PN)
    return (a_PN.to(dtype) * b_PN.to(dtype)).sum(1)


@_routed_mlp_backward_op.register_fake
def _routed_mlp_backward_fake(
    dout_RH,
    x_RH,
    h_PN,
    weights_RK,
    slot_P,
    pair_RK,
    counts_e,
    host_counts,
    up,
    down,
    up_bias,
    down_bias,
    trans_weight,
    experts_key,
    padded,
):
    empty = x_RH.new_empty(0)
    return (
        torch.empty_like(x_RH),
        torch.empty_like(weights_RK),
        torch.empty_like(up),
        torch.empty_like(down),
        empty if up_bias is None else torch.empty_like(up_bias),
        empty if down_bias is None else torch.empty_like(down_bias),
    )


def _setup_context(ctx, inputs, output):
    (
        x_RH,
        weights_RK,
        slot_P,
        pair_RK,
        counts_e,
        host_counts,
        up,
        down,
        up_bias,
        down_bias,
        trans_weight,
        experts_key,
        _,
        padded,
    ) = inputs
    ctx.save_for_backward(x_RH, output[1], weights_RK, slot_P, pair_RK, counts_e, up, down, up_bias, down_bias)
    ctx.options = (host_counts, trans_weight, experts_key, padded)
    ctx.set_materialize_grads(False)  # h's gradient is never used: no (P, 2I) zeros for it


def _backward(ctx, dout_RH, _dh):
    if torch.is_grad_enabled():
        raise double_backward_error("routed_mlp")
    x_RH, h_PN, weights_RK, slot_P, pair_RK, counts_e, up, down, up_bias, down_bias = ctx.saved_tensors
    if dout_RH is None:  # the rows' output unused: a zero gradient (the backward's exchanges still run)
        dout_RH = torch.zeros_like(x_RH)
    host_counts, trans_weight, experts_key, padded = ctx.options
    dx, dweights, d_up, d_down, d_up_bias, d_down_bias = torch.ops.epmoe.routed_mlp_backward(
        dout_RH.contiguous(),
        x_RH,
        h_PN,
        weights_RK,
        slot_P,
        pair_RK,
        counts_e,
        host_counts,
        up,
        down,
        up_bias,
        down_bias,
        trans_weight,
        experts_key,
        padded,
    )
    needs = ctx.needs_input_grad
    return (
        dx if needs[0] else None,
        dweights if needs[1] else None,
        None,
        None,
        None,
        None,
        d_up if needs[6] else None,
        d_down if needs[7] else None,
        d_up_bias if needs[8] else None,
        d_down_bias if needs[9] else None,
        None,
        None,
        None,
        None,
    )


_routed_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def routed_mlp_custom_op(
    experts_key: int,
    x_RH: torch.Tensor,
    weights_RK: torch.Tensor,
    pairs: RowPairs,
    up: torch.Tensor,
    down: torch.Tensor,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    *,
    trans_weight: bool,
) -> torch.Tensor:
    """``(R, H)``: the rows' routed MLP through ``epmoe::routed_mlp`` (see the module docstring);
    ``experts_key``: from :func:`register_experts` (the op asks that experts module for its gate and
    its grouped-matmul backend)."""
    differentiable = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_RH, weights_RK, up, down, up_bias, down_bias)
    )
    compiling = torch.compiler.is_compiling()
    host_counts = None if compiling else pairs.host_counts_e
    # an eager call without gradients runs the op's body itself: at decode sizes the op's dispatch
    # costs as much as the MLP
    op = torch.ops.epmoe.routed_mlp if differentiable or compiling else _routed_mlp
    out_RH, _ = op(
        x_RH,
        weights_RK,
        pairs.slot_P,
        pairs.pair_RK,
        pairs.counts_e,
        host_counts,
        up,
        down,
        up_bias,
        down_bias,
        trans_weight,
        experts_key,
        differentiable,
        pairs.padded,
    )
    return out_RH


def routed_mlp_autograd(experts_forward, x_RH: torch.Tensor, weights_RK: torch.Tensor, pairs: RowPairs) -> torch.Tensor:
    """``(R, H)``: the same as :func:`routed_mlp_custom_op` through plain autograd, for experts run by
    ``experts_forward(x_PH, counts)`` (which keeps what autograd keeps)."""
    K = weights_RK.shape[1]
    y_PH = experts_forward(x_RH[pairs.slot_P // K], pairs.counts)
    return weighted_sum(y_PH, weights_RK, pairs.pair_RK, x_RH.dtype)
