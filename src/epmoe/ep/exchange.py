"""A layer's exchange: how its routed rows reach their experts and come back, behind one interface.

    x_rank_major --exchange.run(x_rank_major, shared)--> (y_rank_major, shared expert's output or None)

(row orders: :mod:`epmoe.comm.layout`). Two implementations, one chosen per call by
:func:`choose_exchange` (from the experts' ``dispatch`` mode, fixed when EP was applied, and the
device of this call's hidden states):

* :class:`AllToAllExchange`: all-to-all-v to the experts' ranks, the experts' whole MLP on the
  expert-major rows (:func:`experts_with_capacity`), all-to-all-v back::

      rank-major --dispatch--> expert-major --experts MLP--> expert-major --combine--> rank-major

* :class:`FusedExchange`: the MLP split across the fused ops, the shared expert's matmuls (where the
  block has one the fused ops can carry, :class:`SharedMLP`) in their communication gaps::

      rank-major --alltoallv_gmm(up)--> h expert-major --gate / activation--> h
                 --gmm_alltoallv(down)--> rank-major           shared: x @ [gate; up], then h_s @ down

Both take the layer's routing plan (its counts already exchanged) and leave the step headers, the
permutation of tokens and the weighted sum to :func:`epmoe.ep.layer.routed_experts`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from epmoe import platform
from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv
from epmoe.comm.layout import prefix, rows_index
from epmoe.ep.config import DROPPED_COUNTER
from epmoe.ep.dispatcher import AllToAllDispatcher, RoutingPlan
from epmoe.experts import experts_forward, gate_activation, packed_weight_names


@dataclass(frozen=True)
class SharedMLP:
    """A block's shared expert ``down(act_fn(gate(x)) * up(x))`` of bias-free Linears, on ``x_TH``."""

    mlp: nn.Module
    x_TH: torch.Tensor


class Exchange(Protocol):
    def run(self, x_rank_major: torch.Tensor, shared: SharedMLP | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y_rank_major, shared_TH or None)``: the routed rows through the experts and back."""


def uses_fused(state, device: torch.device) -> bool:
    """Whether a call on ``device`` takes the fused ops. ``"auto"`` is decided per call (the model may
    move after :func:`epmoe.apply_expert_parallel`): the fused path on accelerators, whose collectives
    run beside the compute, all-to-all-v on CPU, where ``benchmarks/fused_cpu.md`` measured no gain
    from rounds."""
    if state.dispatch == "auto":
        return device.type != "cpu"
    return state.dispatch == "fused"


def choose_exchange(state, plan: RoutingPlan, device: torch.device) -> Exchange:
    """The one place a call's exchange is chosen (see the module docstring)."""
    return FusedExchange(state, plan) if uses_fused(state, device) else AllToAllExchange(state, plan, device)


class AllToAllExchange:
    """All-to-all-v, the experts' MLP, all-to-all-v back (a shared expert, if given, runs on its own)."""

    def __init__(self, state, plan: RoutingPlan, device: torch.device):
        self.state, self.plan = state, plan
        self.dispatcher = AllToAllDispatcher(plan, device)

    def run(self, x_rank_major: torch.Tensor, shared: SharedMLP | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_expert_major = self.dispatcher.dispatch(x_rank_major)
        y_expert_major = experts_with_capacity(self.state, self.plan, x_expert_major)
        return self.dispatcher.combine(y_expert_major), None if shared is None else shared.mlp(shared.x_TH)


def experts_with_capacity(state, plan: RoutingPlan, x_expert_major: torch.Tensor) -> torch.Tensor:
    """The local experts on their expert-major rows; with ``config.capacity_factor``, only the first
    ``C`` rows of each expert (the global order: source rank, then token, then k), the others' outputs
    zero and counted as dropped (see :class:`~epmoe.ep.config.ExpertParallelConfig`)."""
    counts = plan.local_counts
    run = functools.partial(experts_forward, state.local_experts, backend=state.config.gmm_backend,
                            sync_weights=state.sync_weights)
    factor = state.config.capacity_factor
    if factor is None:
        return run(x_expert_major, counts)
    capacity = math.ceil(factor * plan.global_slots / state.shard.num_experts)
    kept = [min(capacity, n) for n in counts]
    state.count_load([n - k for n, k in zip(counts, kept)], (DROPPED_COUNTER,))
    if kept == counts:
        return run(x_expert_major, counts)
    starts = prefix(counts)  # each local expert's first expert-major row
    index = platform.host_to_device(rows_index([(starts[j], k) for j, k in enumerate(kept)], sum(kept)),
                                    x_expert_major.device)
    y_kept = run(x_expert_major[index], kept)
    return y_kept.new_zeros(x_expert_major.shape[0], y_kept.shape[1]).index_copy(0, index, y_kept)


class FusedExchange:
    """``alltoallv_gmm`` (up projection), the experts' gate / activation, ``gmm_alltoallv`` (down
    projection); the shared expert rides in their gaps. Only for experts
    :func:`~epmoe.integrations.experts.fused_ineligible_reason` accepts (packed, no bias, no post-expert norm)."""

    def __init__(self, state, plan: RoutingPlan):
        self.state, self.plan = state, plan

    def run(self, x_rank_major: torch.Tensor, shared: SharedMLP | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        state, plan, experts = self.state, self.plan, self.state.local_experts
        trans_weight = not experts.is_transposed
        up_proj, down_proj = state.sync_weights([getattr(experts, name) for name in packed_weight_names(experts)])
        options = dict(num_chunks=state.config.num_chunks, gmm_backend=state.config.gmm_backend,
                       check=False)  # the counts were exchanged (and agreed) by plan_routing

        shared_up = {}
        if shared is not None:
            gate_up_weight = torch.cat([shared.mlp.gate_proj.weight, shared.mlp.up_proj.weight])  # (2Is, H)
            shared_up = dict(shared_x=shared.x_TH, shared_weight=gate_up_weight, trans_shared_weight=True)
        h_expert_major, shared_gate_up, _ = alltoallv_gmm(
            x_rank_major, up_proj, plan.send_counts, plan.recv_counts, plan.group,
            trans_weight=trans_weight, **shared_up, **options,
        )
        h_expert_major = gate_activation(experts, h_expert_major)

        shared_down = {}
        if shared is not None:
            gate, up = shared_gate_up.chunk(2, dim=-1)
            shared_down = dict(shared_x=shared.mlp.act_fn(gate) * up, shared_weight=shared.mlp.down_proj.weight,
                               trans_shared_weight=True)
        return gmm_alltoallv(
            h_expert_major, down_proj, plan.recv_counts, plan.send_counts, plan.group,
            trans_weight=trans_weight, **shared_down, **options,
        )
