"""The static exchange: equal, fixed-size blocks between every pair of ranks, sizes known in advance.

Rank ``r`` hands rank ``w`` block ``w`` of its buffer and receives each peer's block ``r`` in its
block ``s`` (one ``all_to_all_single`` with equal splits)::

    rank 0 buffer [to 0 | to 1]          rank 0 buffer [from 0 | from 1]
    rank 1 buffer [to 0 | to 1]   ---->  rank 1 buffer [from 0 | from 1]
                  W blocks of B rows                   W blocks of B rows

Nothing about the sizes is data: the shapes are the buffer's, so no count is exchanged or read to
the host, and ``torch.compile`` traces it whole (``torch.distributed``'s functional collectives with
autograd: the backward is the same exchange of the gradients). :func:`count_traffic
<epmoe.comm.all_to_all.count_traffic>` counts it (eager calls only), forward and backward, like
:func:`~epmoe.comm.all_to_all.all_to_all_v`: each buffer's blocks for other ranks, padding included.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from epmoe.comm.all_to_all import record_traffic


def static_exchange(x_WB: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x_WB`` (``(W*B, ...)``: ``W`` blocks of ``B`` rows, block ``w`` for rank ``w``) exchanged
    over ``group`` (``W`` ranks): block ``s`` of the result is what rank ``s`` sent this rank.
    Differentiable (the backward exchanges the gradients back), traceable, same shape and dtype."""
    W = dist.get_world_size(group)
    if x_WB.dim() == 0 or x_WB.shape[0] % W:
        raise ValueError(f"static_exchange(x_WB): expected W*B rows for W={W} ranks, got shape {tuple(x_WB.shape)}")
    counted = not torch.compiler.is_compiling()
    if counted:
        _count(x_WB, W)
    out = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_WB.contiguous(), None, None, group))
    if counted and out.requires_grad:
        out.register_hook(lambda grad: _count(grad, W))
    return out


def _count(x_WB: torch.Tensor, W: int) -> None:
    """Record one exchange of ``x_WB``: its blocks for the ``W - 1`` other ranks."""
    record_traffic(x_WB.shape[0] // W * (W - 1) * math.prod(x_WB.shape[1:]) * x_WB.element_size())
