"""A layer's routing on the sender: its slots sorted by expert, and the counts exchange.

The model's router gives each token ``K`` routing choices (``top_k_index_TK``, ``top_k_weights_TK``);
one choice is a *slot* (``S = T * K``). :func:`sort_slots` sorts this rank's slots by global expert
on the device (the one sort of the layer), :func:`permute_tokens` gathers the rank-major rows from
it, and :func:`unpermute_and_combine` weights the returned rows and sums each token's ``K``::

    slot s = t*K + k     sort_S (stable, by expert)      rank-major rows (to rank r's expert j)
    t0: e2 e0            [t0k1 t1k0 | t0k0 t1k1]          x[sort_S // K]
    t1: e0 e3             e0   e0     e2   e3

:func:`exchange_layer_counts` is the layer's counts exchange (one host read, its step header riding
along: :mod:`epmoe.comm.steps`): every rank learns what it sends to and receives from each expert,
which dispatch, combine and both backward exchanges reuse (:class:`LayerCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from epmoe.comm.counts import exchange_counts_on
from epmoe.comm.layout import RowLayout, inverse_permutation
from epmoe.comm.steps import Position, StepChannel


@dataclass
class SlotOrder:
    """This rank's slots sorted by global expert, on the device (no host read: ``torch.compile``
    traces :func:`sort_slots`)."""

    sort_S: torch.Tensor  # slot ids in rank-major order (sorted by global expert, stable)
    unsort_S: torch.Tensor  # inverse of sort_S
    tokens_per_expert_E: torch.Tensor  # (E,) int64: slots per global expert


@dataclass
class LayerCounts:
    """What one layer forward's counts exchange told this rank, on the host; dispatch, combine and
    their backward all read it."""

    send_counts_WE: list[int]  # (W*e,) rows this rank sends to expert (r, j), rank-major
    recv_counts_WE: list[int]  # (W*e,) rows this rank receives from rank s for local expert j, (s, j)
    ep_size: int  # W
    group: dist.ProcessGroup | None
    global_slots: int  # slots of every rank of the EP group in this forward (T_global * K)
    guards: list[list[int]] = field(default_factory=list)  # each EP rank's epmoe.ep.guard values
    layout: RowLayout = field(init=False)  # the rows' layout, as one round over all local experts

    def __post_init__(self):
        e = len(self.send_counts_WE) // self.ep_size
        self.layout = RowLayout.one_round(self.ep_size, e, self.send_counts_WE, self.recv_counts_WE)

    @property
    def local_counts_e(self) -> list[int]:
        """Rows per local expert ``j`` (summed over source ranks): the grouped matmul's counts."""
        return self.layout.rows_per_expert_e


def sort_slots(top_k_index_TK: torch.Tensor, num_experts: int) -> SlotOrder:
    """This rank's slots sorted by global expert (stable), and how many each expert receives."""
    expert_S = top_k_index_TK.reshape(-1)
    tokens_per_expert_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_S.device)
    tokens_per_expert_E.scatter_add_(0, expert_S.long(), torch.ones_like(expert_S, dtype=torch.int64))
    sort_S = torch.sort(expert_S, stable=True).indices
    return SlotOrder(sort_S, inverse_permutation(sort_S), tokens_per_expert_E)


def exchange_layer_counts(slots: SlotOrder, channel: StepChannel | None, position: Position,
                          rows_dtype: torch.dtype, guard: torch.Tensor | None = None) -> LayerCounts:
    """The counts exchange of ``slots`` with the EP group at ``position`` (``channel``: the model's EP
    step channel, ``None`` on a single rank; one host read either way); the ranks also agree that
    their rows travel in ``rows_dtype``. ``guard``: this rank's :mod:`epmoe.ep.guard` values (``(2,)``
    int64), riding along; every rank's come back in ``LayerCounts.guards``."""
    if channel is None:
        counts = slots.tokens_per_expert_E.tolist()
        return LayerCounts(counts, counts, 1, None, slots.sort_S.numel())
    send_counts, recv_counts, slots_by_rank, guards = exchange_counts_on(
        channel, position, slots.tokens_per_expert_E, rows_dtype,
        guard if guard is not None else slots.tokens_per_expert_E.new_zeros(2))
    return LayerCounts(send_counts, recv_counts, channel.size, channel.group, sum(slots_by_rank), guards)


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` whose inverse is known: the backward is a gather too,
    not an accumulating scatter into a zero tensor."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, dy):
        (inverse,) = ctx.saved_tensors
        return dy[inverse], None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` in the order ``index`` (a permutation with inverse ``inverse``), differentiable."""
    return _PermuteRows.apply(x, index, inverse)


def permute_tokens(hidden_TH: torch.Tensor, slots: SlotOrder, top_k: int) -> torch.Tensor:
    """``(S, H)`` rank-major rows: each token repeated once per routing choice, sorted by expert
    (``x[idx]``, whose backward is index_put)."""
    return hidden_TH[slots.sort_S // top_k]


def unpermute_and_combine(
    y_rank_major: torch.Tensor, top_k_weights_TK: torch.Tensor, slots: SlotOrder, out_dtype: torch.dtype
) -> torch.Tensor:
    """Weight each returned row by its routing weight (on the sender, so the router gets its gradient),
    restore slot order and sum each token's ``K`` rows (a fixed-order reduction: deterministic)."""
    T, K = top_k_weights_TK.shape
    weights_S = permute_rows(top_k_weights_TK.reshape(-1, 1), slots.sort_S, slots.unsort_S).squeeze(1)
    weighted_S = y_rank_major * weights_S.unsqueeze(-1)  # in the wider dtype, as transformers does
    weighted_slots = permute_rows(weighted_S, slots.unsort_S, slots.sort_S)
    return weighted_slots.view(T, K, y_rank_major.shape[-1]).sum(dim=1).to(out_dtype)
