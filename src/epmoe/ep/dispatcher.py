"""Token dispatch and combine: how routed rows reach their expert's rank and come back.

One layer on ``W`` ranks with ``e`` local experts each: rank-major rows (the sender's, sorted by
global expert) travel by all-to-all-v to the source-major order and are permuted to the
expert-major order the grouped matmul reads (the three orders and their letters:
:mod:`epmoe.comm.layout`)::

    rank-major --all-to-all-v--> source-major --permute--> expert-major --experts--> (same, back)

``dispatch`` goes left to right, ``combine`` right to left. Every permutation is an index gather built
from the counts alone, whose backward is the gather by the inverse permutation (no ``index_select``
backward, which fails on some NPU stacks, and no accumulating scatter); repeating each token ``K``
times is ``x[idx]``, whose backward is index_put. A single sort per layer (slots by expert, on the
sender). The counts are exchanged once per
layer (one host synchronisation, the layer's step header riding along: :mod:`epmoe.comm.steps`)
and reused by combine and by both backward exchanges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe import platform
from epmoe.comm import all_to_all_v
from epmoe.comm.counts import counts_exchange
from epmoe.comm.layout import Plan, inverse_permutation, rows_index
from epmoe.comm.steps import Position, StepChannel


@dataclass
class SlotOrder:
    """This rank's slots sorted by global expert, on the device (no host read: ``torch.compile``
    traces :func:`sort_slots`). ``slot`` = one (token, k) routing choice; ``S = T * K`` slots."""

    sort_S: torch.Tensor  # slot ids in rank-major order (sorted by global expert, stable)
    unsort_S: torch.Tensor  # inverse of sort_S
    tokens_per_expert: torch.Tensor  # (E,) int64: slots per global expert


@dataclass
class RoutingPlan:
    """Everything a layer's dispatch, combine and their backward need, on the host, computed once
    per forward from its :class:`SlotOrder` and the counts exchange."""

    send_counts: list[int]  # (W*e,) rows this rank sends to expert (r, j)
    recv_counts: list[int]  # (W*e,) rows this rank receives from rank s for local expert j, (s, j)
    ep_size: int
    num_local_experts: int
    group: dist.ProcessGroup | None
    global_slots: int  # slots of every rank of the EP group in this forward (T_global * K)

    @functools.cached_property
    def layout(self) -> Plan:
        """The exchange's row layout (the fused ops use the same), as one round over all local experts."""
        return Plan.one_round(self.ep_size, self.num_local_experts, self.send_counts, self.recv_counts)

    @property
    def send_splits(self) -> list[int]:
        """Rows this rank sends to each rank."""
        return self.layout.rank_major_splits

    @property
    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank."""
        return self.layout.expert_major_splits_W

    @property
    def local_counts(self) -> list[int]:
        """Rows per local expert ``j`` (summed over source ranks): the grouped matmul's counts."""
        return self.layout.group_sizes_E


def sort_slots(top_k_index_TK: torch.Tensor, num_experts: int) -> SlotOrder:
    """This rank's slots sorted by global expert (stable), and how many each expert receives."""
    expert_S = top_k_index_TK.reshape(-1)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=expert_S.device)
    tokens_per_expert.scatter_add_(0, expert_S.long(), torch.ones_like(expert_S, dtype=torch.int64))
    sort_S = torch.sort(expert_S, stable=True).indices
    return SlotOrder(sort_S, inverse_permutation(sort_S), tokens_per_expert)


def plan_routing(slots: SlotOrder, channel: StepChannel | None, position: Position) -> RoutingPlan:
    """The host plan of ``slots``: the counts exchanged with the EP group at ``position``
    (``channel``: the model's EP step channel, ``None`` on a single rank; one host read either way)."""
    num_experts, num_slots = slots.tokens_per_expert.numel(), slots.sort_S.numel()
    if channel is None:
        send_counts = recv_counts = slots.tokens_per_expert.tolist()
        ep_size, group, slots_by_rank = 1, None, [num_slots]
    else:
        send_counts, recv_counts, slots_by_rank = counts_exchange(channel, position, slots.tokens_per_expert)
        ep_size, group = channel.size, channel.group
    return RoutingPlan(send_counts, recv_counts, ep_size, num_experts // ep_size, group, sum(slots_by_rank))


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


class AllToAllDispatcher:
    """Dispatch / combine over all-to-all-v (also serves a group of one, with no communication)."""

    def __init__(self, plan: RoutingPlan, device: torch.device):
        self.plan = plan
        if plan.ep_size > 1:
            layout, e = plan.layout, plan.num_local_experts
            to_expert_major = rows_index(layout.to_expert_major(0, e), layout.rows_expert_major)
            self.to_expert_major = platform.host_to_device(to_expert_major, device)
            self.to_source_major = platform.host_to_device(inverse_permutation(to_expert_major), device)

    def dispatch(self, x_rank_major: torch.Tensor) -> torch.Tensor:
        """``(sum(send_counts), H)`` rank-major -> ``(sum(recv_counts), H)`` expert-major."""
        plan = self.plan
        if plan.ep_size == 1:
            return x_rank_major
        x_source_major = all_to_all_v(x_rank_major, plan.recv_splits, plan.send_splits, plan.group)
        return permute_rows(x_source_major, self.to_expert_major, self.to_source_major)

    def combine(self, y_expert_major: torch.Tensor) -> torch.Tensor:
        """``(sum(recv_counts), H)`` expert-major -> ``(sum(send_counts), H)`` rank-major."""
        plan = self.plan
        if plan.ep_size == 1:
            return y_expert_major
        y_source_major = permute_rows(y_expert_major, self.to_source_major, self.to_expert_major)
        return all_to_all_v(y_source_major, plan.send_splits, plan.recv_splits, plan.group)


def permute_tokens(hidden_TH: torch.Tensor, slots: SlotOrder, top_k: int) -> torch.Tensor:
    """``(S, H)`` rank-major rows: each token repeated once per routing choice, sorted by expert."""
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
