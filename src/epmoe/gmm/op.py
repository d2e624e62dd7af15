"""``grouped_mm``: the grouped matmul users call, as a ``torch.library`` custom op with its autograd.

    grouped_mm(x_TD, weight, counts)            validate shapes and dtypes (traceable)
      -> epmoe::grouped_mm (custom op)          choose: $EPMOE_GMM_BACKEND, else backend=, else
         |                                      ("auto") the first eligible backend (or ask the
         |                                      caller's BackendChoice); counts as it takes them: a
         |                                      device tensor, unread, for a backend with
         |                                      device_counts (torch), else read to the host once
         |                                      and validated (host lists: validated first)
         |--forward-->  run_grouped_mm: backend.forward(x, W)             -> y_TN
         <-backward--   epmoe::grouped_mm_backward: the same choice, then run_grouped_mm_backward:
                        backend.forward(dy, W, transposed) -> dx_TD
                        backend.grad_weight(x, dy)         -> dW (zero for empty groups)

Both ops are ``torch.library`` custom ops with fake kernels (output shapes from the operands alone)
and registered autograd, so ``torch.compile`` traces a grouped matmul as one opaque call, in any
dtype, and never the backend choice, its logging or the host read of the counts. The choice, the
validation and the bodies the ops run are the backends' side, :mod:`epmoe.gmm.registry`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epmoe import errors
from epmoe.errors import double_backward_error
from epmoe.gmm.backend import GmmBackend
from epmoe.gmm.operands import backend_counts, check_operands, counts_list
from epmoe.gmm.registry import BackendChoice, choice_of, run_grouped_mm, run_grouped_mm_backward, select_backend


def _op_backend(
    x_TD: torch.Tensor,
    weight: torch.Tensor,
    trans_weight: bool,
    backend: str,
    choice: int,
    host_counts: list[int] | None,
    backward: bool,
) -> GmmBackend:
    """The backend of one ``epmoe::grouped_mm`` call: its caller's :class:`BackendChoice` (``choice``
    >= 0), else chosen here from ``backend`` (:func:`select_backend`)."""
    if choice >= 0:
        return choice_of(choice).backend_for([(x_TD, weight, trans_weight)], counts=host_counts, backward=backward)
    return select_backend(
        x_TD, weight, trans_weight=trans_weight, backend=backend, counts=host_counts, backward=backward
    )


@torch.library.custom_op("epmoe::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x_TD: torch.Tensor,
    weight: torch.Tensor,
    counts_G: torch.Tensor,
    host_counts: list[int] | None,
    trans_weight: bool,
    backend: str,
    choice: int,
    differentiable: bool,
) -> torch.Tensor:
    """The op behind :func:`grouped_mm`: the backend chosen here and the counts read to the host
    here where it needs them (once), so that ``torch.compile`` traces neither (only
    :func:`_grouped_mm_fake`)."""
    chosen = _op_backend(x_TD, weight, trans_weight, backend, choice, host_counts, differentiable)
    counts = backend_counts(chosen, counts_G, host_counts, x_TD, weight.shape[0])
    return run_grouped_mm(x_TD, weight, counts, trans_weight, chosen)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x_TD, weight, counts_G, host_counts, trans_weight, backend, choice, differentiable):
    return x_TD.new_empty(x_TD.shape[0], weight.shape[1 if trans_weight else 2])


@torch.library.custom_op("epmoe::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(
    dy_TN: torch.Tensor,
    x_TD: torch.Tensor,
    weight: torch.Tensor,
    counts_G: torch.Tensor,
    host_counts: list[int] | None,
    trans_weight: bool,
    backend: str,
    choice: int,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx_TD, dW)`` on the backend the forward ran (chosen again from the same operands, which
    a :class:`BackendChoice` answers without judging; the choice depends on nothing else); a
    gradient not needed is an empty tensor."""
    chosen = _op_backend(x_TD, weight, trans_weight, backend, choice, host_counts, True)
    counts = backend_counts(chosen, counts_G, host_counts, dy_TN, weight.shape[0])
    return run_grouped_mm_backward(dy_TN, x_TD, weight, counts, trans_weight, chosen, need_dx, need_dw)


@_grouped_mm_backward_op.register_fake
def _grouped_mm_backward_fake(
    dy_TN, x_TD, weight, counts_G, host_counts, trans_weight, backend, choice, need_dx, need_dw
):
    empty = x_TD.new_empty(0)
    return (torch.empty_like(x_TD) if need_dx else empty), (torch.empty_like(weight) if need_dw else empty)


def _setup_context(ctx, inputs, output):
    x_TD, weight, counts_G, host_counts, trans_weight, backend, choice, _ = inputs
    ctx.save_for_backward(x_TD, weight, counts_G)
    ctx.options = (host_counts, trans_weight, backend, choice)


def _backward(ctx, dy_TN):
    if torch.is_grad_enabled():
        raise double_backward_error("grouped_mm")
    x_TD, weight, counts_G = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    host_counts, trans_weight, backend, choice = ctx.options
    dx, dw = torch.ops.epmoe.grouped_mm_backward(
        dy_TN, x_TD, weight, counts_G, host_counts, trans_weight, backend, choice, need_dx, need_dw
    )
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None, None, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    *,
    trans_weight: bool = False,
    backend: str | BackendChoice = "auto",
) -> torch.Tensor:
    """Grouped matmul: rows ``[sum(counts[:g]), sum(counts[:g+1]))`` of ``x`` times ``weight[g]``.

    Args:
        x: ``(T, D)`` rows sorted by group.
        weight: ``(G, D, N)``, or ``(G, N, D)`` (``nn.Linear`` layout) with ``trans_weight=True``,
            read without a transposed copy.
        counts: ``G`` non-negative ints summing to ``T`` (list, tuple, or integer tensor on any
            device). A backend that takes its counts on the device (``torch``) gets a tensor unread
            (its values are trusted, not validated); for the others the op reads it to the host once.
            Under ``torch.compile`` a device tensor costs no graph break either way.
        trans_weight: whether ``weight`` is ``(G, N, D)``.
        backend: ``"auto"``, a registered backend name, ``"prefer:NAME"`` (``NAME`` where it takes
            the call, else as ``"auto"``), or a :class:`BackendChoice` (the backend it chose for the
            family of grouped matmuls this call belongs to); ``$EPMOE_GMM_BACKEND`` overrides it.

    Returns:
        ``(T, N)`` in ``x``'s dtype; differentiable in ``x`` and ``weight``.
    """
    check_operands(x, weight, trans_weight)
    choice = -1
    if isinstance(backend, BackendChoice):
        backend, choice = backend.requested, backend.key
    if not isinstance(backend, str):
        raise TypeError(f"grouped_mm(backend): expected a str or a BackendChoice, got {type(backend).__name__}")
    host_counts = None
    if isinstance(counts, torch.Tensor):
        errors.check_counts_tensor("grouped_mm(counts)", counts)  # the op reads the values where it must
        counts_G = counts
    else:
        host_counts = counts_list(counts, weight.shape[0], x.shape[0])
        counts_G = torch.tensor(host_counts, dtype=torch.int64)
        if torch.compiler.is_compiling():
            host_counts = None  # a traced list would be a constant of the graph
    differentiable = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return torch.ops.epmoe.grouped_mm(
        x.contiguous(), weight, counts_G, host_counts, trans_weight, backend, choice, differentiable
    )
