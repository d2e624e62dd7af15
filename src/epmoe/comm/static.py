"""The static exchange: equal, fixed-size blocks between every pair of ranks, sizes known in advance.

Rank ``r`` hands rank ``w`` block ``w`` of its buffer and receives each peer's block ``r`` in its
block ``s`` (one ``all_to_all_single`` with equal splits)::

    rank 0 buffer [to 0 | to 1]          rank 0 buffer [from 0 | from 1]
    rank 1 buffer [to 0 | to 1]   ---->  rank 1 buffer [from 0 | from 1]
                  W blocks of B rows                   W blocks of B rows

Nothing about the sizes is data: the shapes are the buffer's, so no count is exchanged or read to
the host, and ``torch.compile`` traces it whole: traced, the exchange is ``torch.distributed``'s
functional ``all_to_all_single``; run eagerly, the plain blocking one (the functional collectives'
tensor subclass costs more than a small collective on CPU). The backward is the same exchange of the
gradients. :func:`static_exchange_with` sends
an int64 block (a header, indices) and a float block to each rank in one collective, their bytes
side by side::

    block for rank w   [ int64 words (L) | float rows (B x C), as bytes ]   one all_to_all_single
 :func:`count_traffic
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
    return _Exchange.apply(x_WB, group)


class _Exchange(torch.autograd.Function):
    """The exchange forward, the same exchange of the gradients backward."""

    @staticmethod
    def forward(ctx, x_WB, group):
        ctx.group = group
        return _all_to_all(x_WB, group)

    @staticmethod
    def backward(ctx, dy_WB):
        return _all_to_all(dy_WB, ctx.group), None


def _all_to_all(x_WB: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One ``all_to_all_single`` with equal splits: functional where traced, else blocking; counted
    by :func:`~epmoe.comm.all_to_all.count_traffic` (eager calls)."""
    x_WB = x_WB.contiguous()
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_to_all_single(x_WB, None, None, group))
    _count(x_WB, dist.get_world_size(group))
    out = torch.empty_like(x_WB)
    dist.all_to_all_single(out, x_WB, group=group)
    return out


def static_exchange_with(
    words_WL: torch.Tensor, x_WB: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(words, x)`` received: :func:`static_exchange` of ``words_WL`` (``(W, L)`` int64, row ``w``
    for rank ``w``) and of ``x_WB`` (``(W*B, C)`` floats) in one collective, the float block
    differentiable (its backward: :func:`static_exchange` of the gradients, one collective)."""
    W = dist.get_world_size(group)
    if words_WL.dim() != 2 or words_WL.shape[0] != W or words_WL.dtype != torch.int64:
        raise ValueError(
            f"static_exchange_with(words_WL): expected ({W}, L) int64, got {tuple(words_WL.shape)} {words_WL.dtype}"
        )
    if x_WB.dim() != 2 or x_WB.shape[0] % W:
        raise ValueError(f"static_exchange_with(x_WB): expected (W*B, C) for W={W}, got {tuple(x_WB.shape)}")
    return _WordsAndRows.apply(words_WL, x_WB, group)


class _WordsAndRows(torch.autograd.Function):
    """Both blocks as bytes in one exchange forward; the float block's gradient back in one exchange."""

    @staticmethod
    def forward(ctx, words_WL, x_WB, group):
        W, L = words_WL.shape
        ctx.group = group
        row_bytes = x_WB.shape[0] // W * x_WB.shape[1] * x_WB.element_size()
        bytes_WN = torch.cat(
            [
                words_WL.contiguous().view(torch.uint8).view(W, L * 8),
                x_WB.contiguous().view(torch.uint8).view(W, row_bytes),
            ],
            dim=1,
        )
        got_WN = _all_to_all(bytes_WN, group)
        words = got_WN[:, : L * 8].contiguous().view(torch.int64)
        x = got_WN[:, L * 8 :].contiguous().view(x_WB.dtype).view(x_WB.shape)
        ctx.mark_non_differentiable(words)
        return words, x

    @staticmethod
    def backward(ctx, _dwords, dx_WB):
        return None, static_exchange(dx_WB, ctx.group), None


def _count(x_WB: torch.Tensor, W: int) -> None:
    """Record one exchange of ``x_WB``: its blocks for the ``W - 1`` other ranks."""
    record_traffic(x_WB.shape[0] // W * (W - 1) * math.prod(x_WB.shape[1:]) * x_WB.element_size())
