"""The dispatcher interface, and the counts exchange the transports that need one share.

A :class:`Dispatcher` moves one layer's tokens to the ranks of their experts and their outputs back
(one subclass per transport, :mod:`epmoe.ep.dispatch`). It is built once per layer, when EP is
applied, and kept as its state's ``transport``; it holds only what was decided then (nothing that
points back at the layer: a deep copy of the model copies it as a value). Each call passes the
layer's :class:`~epmoe.ep.state.ExpertParallelState` and gets back everything of that call in a
frozen *meta* record of the transport's own, which ``experts`` and ``combine`` read::

    rows, meta = dispatch(state, hidden_TH, top_k_index_TK, top_k_weights_TK)
    out_rows   = experts(state, rows, meta)         the local experts' MLP on the rows
    out_TH     = combine(state, out_rows, meta)     back to the sender, weighted, summed per token

:func:`exchange_layer_counts` is a layer forward's counts exchange (the one host read of an EP
layer, its step header and the step guard's values riding along: :mod:`epmoe.comm.steps`,
:mod:`epmoe.ep.guard`): every rank learns how many slots it sends to and receives for each expert
and how many rows it sends to and receives from each rank (:class:`LayerCounts`); the forward
becomes the layer's next *call* (its backward's step headers name it). With ``W = 2`` ranks and
``e = 2`` local experts::

    rank 0 slots per global expert [a0 a1 | a2 a3]    rank 1 [b0 b1 | b2 b3]
    rank 0 send_counts_WE [a0 a1 a2 a3]   recv_counts_WE [a0 a1 | b0 b1]   local_counts_e [a0+b0, a1+b1]
    rank 1 send_counts_WE [b0 b1 b2 b3]   recv_counts_WE [a2 a3 | b2 b3]   local_counts_e [a2+b2, a3+b3]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.counts import exchange_counts_on
from epmoe.comm.steps import FORWARD, Position
from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.guard import check as check_guard
from epmoe.ep.state import ExpertParallelState


@dataclass(frozen=True)
class SharedExpert:
    """A block's shared expert ``down(act_fn(gate(x)) * up(x))`` of bias-free Linears (``mlp``), and
    the block's gate on its output, ``sigmoid(gate(x))`` (Qwen2-MoE), or ``None`` (DeepSeek)."""

    mlp: nn.Module
    gate: nn.Module | None = None


class Dispatcher(ABC):
    """One layer's transport (see the module docstring); ``name`` is its ``ExpertParallelConfig.dispatch``
    value. ``carries_shared``: whether :meth:`dispatch` takes a block's shared expert, computed in the
    transport's communication gaps and added by :meth:`combine`. Built by
    :func:`epmoe.ep.dispatch.make_dispatcher` from the experts module and the config."""

    name: ClassVar[str]
    carries_shared: ClassVar[bool] = False

    def __init__(self, experts: nn.Module, config: ExpertParallelConfig):
        """Nothing to decide by default: a transport that reads the experts' layout overrides this."""

    def traced_whole(self, state: ExpertParallelState) -> bool:
        """Whether a call runs on the device alone (no host read, no collective), which
        ``torch.compile`` traces whole; otherwise :func:`epmoe.ep.layer.routed_experts` runs it behind
        one graph break."""
        return False

    @abstractmethod
    def dispatch(
        self,
        state: ExpertParallelState,
        hidden_TH: torch.Tensor,
        top_k_index_TK: torch.Tensor,
        top_k_weights_TK: torch.Tensor,
        shared: SharedExpert | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """``(rows, meta)``: the tokens on their experts' ranks, in the transport's row order, and what
        :meth:`experts` and :meth:`combine` need of this call. ``shared``: only where
        :attr:`carries_shared`."""

    @abstractmethod
    def experts(self, state: ExpertParallelState, rows: torch.Tensor, meta: Any) -> torch.Tensor:
        """What the local experts compute on ``rows`` (same rows, same order)."""

    @abstractmethod
    def combine(self, state: ExpertParallelState, out_rows: torch.Tensor, meta: Any) -> torch.Tensor:
        """``(T, H)``: each token's experts' outputs back on its rank, weighted and summed (plus the
        shared expert's, where one was given)."""


@dataclass(frozen=True)
class LayerCounts:
    """What one layer forward's counts exchange told this rank, on the host (see the module docstring)."""

    send_counts_WE: list[int]  # (W*e,) slots this rank sends to expert (r, j), rank-major
    recv_counts_WE: list[int]  # (W*e,) slots this rank receives from rank s for local expert j, (s, j)
    local_counts_e: list[int]  # (e,) slots per local expert j, summed over source ranks: the grouped matmuls' counts
    group: dist.ProcessGroup | None  # the group the rows travel on (the step channel's; None on a single rank)
    global_slots: int  # slots of every rank of the EP group in this forward (T_global * K)
    send_rows_W: list[int]  # (W,) rows this rank sends to each rank (empty on a single rank)
    recv_rows_W: list[int]  # (W,) rows this rank receives from each rank (empty on a single rank)


def exchange_layer_counts(
    state: ExpertParallelState,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    rows_W: torch.Tensor | None = None,
) -> LayerCounts:
    """The counts exchange of a layer forward (see the module docstring): this rank's slots per
    global expert from ``top_k_index_TK`` and ``rows_W`` (``(W,)`` int64 on the device, rows this rank
    sends to each rank; ``None``: none counted), with the EP group (one host read either way; the ranks
    also agree that their rows travel in ``hidden_TH``'s dtype). Adds the local experts' slots to the
    layer's load counters."""
    state.calls += 1
    shard, channel, model = state.shard, state.model.channel, state.model
    position = Position(state.layer, FORWARD, state.calls)  # the layer's next call
    guarded = state.layer == 0 and model.started and model.policy.guards  # model.guarded, read per forward
    guard = model.guard_payload(hidden_TH.device) if guarded else None
    expert_S = top_k_index_TK.reshape(-1).long()
    slots_E = torch.zeros(shard.num_experts, dtype=torch.int64, device=expert_S.device)
    slots_E.scatter_add_(0, expert_S, torch.ones_like(expert_S))
    if channel is None:
        slots = slots_E.tolist()
        counts = LayerCounts(slots, slots, slots, None, sum(slots), [], [])
    else:
        W, e = channel.size, shard.num_local_experts
        rows_W = slots_E.new_zeros(W) if rows_W is None else rows_W
        guard = slots_E.new_zeros(2) if guard is None else guard
        extra = torch.cat([rows_W.view(W, 1), guard.view(1, -1).expand(W, -1)], dim=1)
        exchanged = exchange_counts_on(channel, position, slots_E, hidden_TH.dtype, extra)
        recv = exchanged.recv_counts
        counts = LayerCounts(
            exchanged.send_counts,
            recv,
            [sum(recv[s * e + j] for s in range(W)) for j in range(e)],
            channel.group,
            sum(exchanged.slots_by_rank),
            [row[0] for row in exchanged.extras_sent],
            [row[0] for row in exchanged.extras_received],
        )
        if guarded:
            check_guard([row[1:] for row in exchanged.extras_received], position.describe(channel.layer_names))
    state.count_load(counts.local_counts_e)
    return counts
