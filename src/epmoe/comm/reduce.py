"""Sums over a group whose ranks hold the same tokens: the shared-batch transport's two collectives.

Where every rank of a group holds the same batch (transformers' EP with ``ep_size == tp_size``), each
rank computes a *partial* result from the part of the model it holds (its own experts) and the group
adds the parts::

    forward    out = sum over ranks of partial_r            summed(partial, group): an all-reduce
    backward   d(input) = sum over ranks of d_r(input)       gradients_summed(input, group): the input
                                                             unchanged, its gradient all-reduced

``summed``'s backward is the identity (each rank's gradient of the sum is the whole gradient, which
every rank holds alike) and ``gradients_summed``'s forward is. Traced by ``torch.compile`` they are
``torch.distributed``'s functional all-reduce; run eagerly, the plain blocking one.
:func:`~epmoe.comm.all_to_all.count_traffic` counts an all-reduce of ``n`` bytes over ``W`` ranks as a
ring's ``2 (W - 1) / W * n`` bytes to peers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from epmoe.comm.all_to_all import record_traffic


def summed(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of every rank's ``partial`` over ``group`` (same shape and dtype on every rank);
    differentiable, its backward the identity."""
    if not isinstance(partial, torch.Tensor):
        raise TypeError(f"summed(partial): expected a tensor, got {type(partial).__name__}")
    return _Summed.apply(partial, group)


def gradients_summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` itself, its gradient summed over ``group`` in backward (each rank's holds only the
    part its own share of the model contributed)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gradients_summed(x): expected a tensor, got {type(x).__name__}")
    return _GradientsSummed.apply(x, group)


class _Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        return _all_reduce(partial, group)

    @staticmethod
    def backward(ctx, dout):
        return dout, None


class _GradientsSummed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return _all_reduce(dx, ctx.group), None


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor: ``x`` summed over ``group`` (functional where traced, else blocking; counted by
    :func:`~epmoe.comm.all_to_all.count_traffic`, eager calls)."""
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    W = dist.get_world_size(group)
    record_traffic(2 * (W - 1) * x.numel() * x.element_size() // W)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out
