"""Expert replicas' weight exchange: some experts' weights lent, for one call, to the ranks that compute their rows.

Each owner sends the experts a replica plan names (:mod:`epmoe.ep.replicas`) to their helpers, one
all-to-all-v per weight tensor (the sender's copy of its experts is the only copy made); in backward
the reverse exchanges bring each copy's gradient back to its owner, which adds it into the gradient of
its own weights in place, on the lent experts' slices only::

    owner 0  up (e, N, H), down (e, H, I)          lends expert j to helper 1
      up[j], down[j]  --all-to-all-v-->  helper 1: copies up (1, N, H), down (1, H, I)
    backward:  d copies  --all-to-all-v-->  owner 0: d up[j] += ..., d down[j] += ...

:func:`lend_expert_weights` returns the owner's weights too, as the node's outputs: the owner's own
forward uses them, so every rank runs the node's backward (and its reverse exchanges), also one that
lends or borrows nothing. Every rank of the group calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from epmoe.comm.all_to_all import all_to_all_v, record_replica_weights


def lend_expert_weights(
    weights: Sequence[torch.Tensor | None],
    send_index: list[int],
    send_W: list[int],
    recv_W: list[int],
    group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """``(own, copies)``: ``weights`` (``(e, ...)`` per local expert; ``None``: absent, stays ``None``)
    to use as they are, and the experts others lend this rank, ``(sum(recv_W), ...)`` per tensor,
    source-major. This rank lends its local experts ``send_index`` (destination-major: ``send_W[r]``
    of them to rank ``r``). Differentiable: each copy's gradient is added to its owner's."""
    if len(send_index) != sum(send_W):
        raise ValueError(
            f"lend_expert_weights(send_index): {len(send_index)} experts for send_W summing to {sum(send_W)}"
        )
    present = [w for w in weights if w is not None]
    out = _LendWeights.apply((send_index, send_W, recv_W, group), *present)
    own, copies = iter(out[: len(present)]), iter(out[len(present) :])
    return [None if w is None else next(own) for w in weights], [None if w is None else next(copies) for w in weights]


class _LendWeights(torch.autograd.Function):
    """``_LendWeights.apply((send_index, send_W, recv_W, group), *weights)``: ``(*weights, *copies)``
    (see :func:`lend_expert_weights`); backward adds each copy's returned gradient into its owner's."""

    @staticmethod
    def forward(ctx, lending, *weights: torch.Tensor):
        send_index, send_W, recv_W, group = lending
        index = torch.tensor(send_index, dtype=torch.int64, device=weights[0].device)
        ctx.lending, ctx.shapes, ctx.dtypes = (
            (index, send_W, recv_W, group),
            [w.shape for w in weights],
            [w.dtype for w in weights],
        )
        copies = []
        for w in weights:
            sent = w.index_select(0, index)
            # every row goes to another rank; its gradient comes back the same way
            record_replica_weights(sent.numel() * sent.element_size() * (2 if w.requires_grad else 1))
            copies.append(all_to_all_v(sent, recv_W, send_W, group))
        return (*(w.view_as(w) for w in weights), *copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        index, send_W, recv_W, group = ctx.lending
        k = len(ctx.shapes)
        own_grads, copy_grads = grads[:k], grads[k:]
        out = []
        for i, shape in enumerate(ctx.shapes):
            if not ctx.needs_input_grad[1 + i]:
                out.append(None)
                continue
            d_copy = copy_grads[i]
            if d_copy is None:  # this rank's copies took no part in the loss (it borrowed none)
                d_copy = torch.zeros((sum(recv_W), *shape[1:]), dtype=ctx.dtypes[i], device=index.device)
            returned = all_to_all_v(d_copy.contiguous(), send_W, recv_W, group)
            d_own = own_grads[i]
            if d_own is None:
                d_own = torch.zeros(shape, dtype=returned.dtype, device=returned.device)
            elif not d_own.is_contiguous():
                d_own = d_own.contiguous()
            # in place, the lent experts' slices only: the gradient is the owner's forward's, fresh
            out.append(d_own.index_add_(0, index, returned))
        return (None, *out)
