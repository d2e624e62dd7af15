"""The shared-batch transport: every rank of the EP group holds the same tokens; nothing moves to the experts.

Where the EP group shares one batch (transformers' EP with ``ep_size == tp_size``: the TP group is the
EP group), each rank already holds every token: its local experts run the pairs of the batch routed
to them, and one all-reduce adds the ranks' partial outputs. ``W = 2``, ``e = 2``, ``K = 2``, token
``t0 -> e0, e3``::

    rank 0: rows = the tokens; pairs (t0, k=0 -> local 0)             partial[t0] = w0 * e0(t0)
    rank 1: rows = the tokens; pairs (t0, k=1 -> local 1)             partial[t0] = w1 * e3(t0)
       --all-reduce (comm.reduce.summed)-->  out[t0] = w0 * e0(t0) + w1 * e3(t0) on both ranks

The pairs are every ``(token, k)``, the local ones expert-major then the others as padding, which
the grouped matmuls leave out (:func:`epmoe.ep.routing.pair_rows` with ``padded``): no counts
exchange, no host read, traced whole by ``torch.compile``; each pair is computed once in the group,
on its expert's rank. Backward: each rank's gradients of the tokens and of the routing weights hold
only its experts' part, summed over the group (:func:`epmoe.comm.reduce.gradients_summed`): one
forward and two backward all-reduces, nothing read to the host.

With the step checks on (``check_steps``, the default on CPU) each call first exchanges its step
header and batch size: ranks out of step, or holding batches of different sizes (not one shared
batch), raise on every rank before the all-reduce, which would otherwise fail or hang on them (one
host read; without the checks the call is traced whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.reduce import gradients_summed, summed
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, RoutedRows
from epmoe.ep.routing import pair_rows


@dataclass(frozen=True)
class SharedBatchMeta:
    """One call of :class:`SharedBatchDispatcher`: what :meth:`~SharedBatchDispatcher.combine` reads."""

    arrived: Arrived
    group: dist.ProcessGroup | None  # the group whose partial outputs are summed (None: a group of one)


class SharedBatchDispatcher(Dispatcher):
    """The tokens stay; the ranks' partial outputs are summed (see the module docstring)."""

    name = "shared"
    needs_counts = False

    def traced_whole(self, checks: bool) -> bool:
        return not checks

    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, SharedBatchMeta]:
        """``(x_TH, meta)``: the tokens themselves, their pairs with this rank's experts."""
        shard, group = link.shard, link.channel.group if link.channel is not None else None
        e = shard.num_local_experts
        if link.checks and group is not None:
            _check_one_batch(link, hidden_TH)
        if group is not None and torch.is_grad_enabled():
            hidden_TH = gradients_summed(hidden_TH, group)
            top_k_weights_TK = gradients_summed(top_k_weights_TK, group)
        local_TK = top_k_index_TK - shard.local_start
        local_TK = local_TK.masked_fill((local_TK < 0) | (local_TK >= e), e)
        pairs = pair_rows(local_TK, e, padded=True)
        return hidden_TH, SharedBatchMeta(Arrived(RoutedRows(top_k_weights_TK, pairs), pairs.counts_e), group)

    def combine(self, y_TH: torch.Tensor, meta: SharedBatchMeta) -> torch.Tensor:
        """``(T, H)``: the ranks' partial outputs summed."""
        return y_TH if meta.group is None else summed(y_TH, meta.group)


def _check_one_batch(link: Link, hidden_TH: torch.Tensor) -> None:
    """``ValueError`` on every rank where the ranks' batches differ in size (one header exchange)."""
    channel = link.channel
    T = hidden_TH.shape[0]
    rows_W1 = torch.full((channel.size, 1), T, dtype=torch.int64, device=hidden_TH.device)
    received, _ = channel.exchange(link.position, rows_W1)
    sizes = [row[0] for row in received]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"epmoe: {link.shard.module_name}: the EP group was built to share one batch (ep_size == tp_size), "
            f"but its ranks hold {sizes} tokens: every rank of a TP group must be given the same batch"
        )
