"""Dispatch and combine: how a layer's rank-major rows reach their local experts and come back.

One interface, one class per transport (``ExpertParallelConfig.dispatch`` names the transport)::

    x_rank_major --dispatch--> x_expert_major --experts--> y_expert_major --combine--> y_rank_major

(row orders and letters: :mod:`epmoe.comm.layout`). Both take the layer's :class:`LayerCounts` (its
counts already exchanged); the step headers, the permutation of tokens and the weighted sum stay
with :func:`epmoe.ep.layer.routed_experts`.

* :class:`AllToAllDispatcher`: all-to-all-v, then a permutation from source-major to expert-major;
  the experts' whole MLP (with ``capacity_factor``, on each expert's first rows only); the reverse::

      rank-major --all-to-all-v--> source-major --permute--> expert-major --MLP--> (same, back)

  Every permutation is an index gather built from the counts alone, whose backward is the gather by
  the inverse permutation (no ``index_select`` backward, which fails on some NPU stacks, and no
  accumulating scatter). With a group of one there is nothing to move.

* :class:`FusedDispatcher`: the MLP split across the fused ops, a shared expert's matmuls (where the
  block has one they can carry, :class:`SharedMLP`) in their communication gaps::

      rank-major --alltoallv_gmm(up)--> h expert-major --gate / activation--> h
                 --gmm_alltoallv(down)--> rank-major           shared: x @ [gate; up], then h_s @ down

:func:`make_dispatcher` picks the class for a call from the state's transport and the call's device.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from epmoe import platform
from epmoe.comm import all_to_all_v
from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv
from epmoe.comm.layout import inverse_permutation, prefix, rows_index
from epmoe.ep.config import DROPPED_COUNTER
from epmoe.ep.experts import packed_weight_names
from epmoe.ep.routing import LayerCounts, permute_rows
from epmoe.ep.state import ExpertParallelState


@dataclass(frozen=True)
class SharedMLP:
    """A block's shared expert ``down(act_fn(gate(x)) * up(x))`` of bias-free Linears, on ``x_TH``."""

    mlp: nn.Module
    x_TH: torch.Tensor


class Dispatcher(ABC):
    """One layer call's transport (see the module docstring). ``shared``: a shared expert the
    transport computes alongside (``None``: the block computes its own)."""

    def __init__(self, state: ExpertParallelState, counts: LayerCounts, device: torch.device,
                 shared: SharedMLP | None = None):
        self.state, self.counts, self.device, self.shared = state, counts, device, shared

    @abstractmethod
    def dispatch(self, x_rank_major: torch.Tensor) -> torch.Tensor:
        """``(sum(send_counts), H)`` rank-major -> the expert-major rows :meth:`experts` reads."""

    @abstractmethod
    def experts(self, x_expert_major: torch.Tensor) -> torch.Tensor:
        """What the local experts compute between :meth:`dispatch` and :meth:`combine`."""

    @abstractmethod
    def combine(self, y_expert_major: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y_rank_major (sum(send_counts), H), shared_TH or None)``."""


class AllToAllDispatcher(Dispatcher):
    """All-to-all-v around the experts' whole MLP (a shared expert, if given, runs on its own)."""

    def __init__(self, state, counts, device, shared=None):
        super().__init__(state, counts, device, shared)
        if counts.ep_size > 1:
            layout, e = counts.layout, len(counts.local_counts_e)
            to_expert_major = rows_index(layout.to_expert_major(0, e), layout.rows_expert_major)
            self.to_expert_major = platform.host_to_device(to_expert_major, device)
            self.to_source_major = platform.host_to_device(inverse_permutation(to_expert_major), device)

    def dispatch(self, x_rank_major):
        counts = self.counts
        if counts.ep_size == 1:
            return x_rank_major
        layout = counts.layout
        x_source_major = all_to_all_v(x_rank_major, layout.expert_major_splits_W, layout.rank_major_splits,
                                      counts.group)
        return permute_rows(x_source_major, self.to_expert_major, self.to_source_major)

    def experts(self, x_expert_major):
        """The local experts on their expert-major rows; with ``config.capacity_factor``, only the
        first ``C`` rows of each expert (the global order: source rank, then token, then k), the
        others' outputs zero and counted as dropped (see :class:`~epmoe.ep.config.ExpertParallelConfig`)."""
        state, counts = self.state, self.counts.local_counts_e
        factor = state.config.capacity_factor
        if factor is None:
            return state.experts.forward(x_expert_major, counts, sync_weights=state.sync_weights)
        capacity = math.ceil(factor * self.counts.global_slots / state.shard.num_experts)
        kept = [min(capacity, n) for n in counts]
        state.count_load([n - k for n, k in zip(counts, kept)], (DROPPED_COUNTER,))
        if kept == counts:
            return state.experts.forward(x_expert_major, counts, sync_weights=state.sync_weights)
        starts = prefix(counts)  # each local expert's first expert-major row
        index = platform.host_to_device(rows_index([(starts[j], k) for j, k in enumerate(kept)], sum(kept)),
                                        x_expert_major.device)
        y_kept = state.experts.forward(x_expert_major[index], kept, sync_weights=state.sync_weights)
        return y_kept.new_zeros(x_expert_major.shape[0], y_kept.shape[1]).index_copy(0, index, y_kept)

    def combine(self, y_expert_major):
        shared_TH = None if self.shared is None else self.shared.mlp(self.shared.x_TH)
        counts = self.counts
        if counts.ep_size == 1:
            return y_expert_major, shared_TH
        layout = counts.layout
        y_source_major = permute_rows(y_expert_major, self.to_source_major, self.to_expert_major)
        return all_to_all_v(y_source_major, layout.rank_major_splits, layout.expert_major_splits_W,
                            counts.group), shared_TH


class FusedDispatcher(Dispatcher):
    """``alltoallv_gmm`` (up projection), the experts' gate / activation, ``gmm_alltoallv`` (down
    projection); the shared expert rides in their gaps. Only for experts
    :func:`~epmoe.ep.recognize.fused_ineligible_reason` accepts (packed, no bias, no post-expert norm)."""

    def __init__(self, state, counts, device, shared=None):
        super().__init__(state, counts, device, shared)
        experts = state.local_experts
        self.trans_weight = not experts.is_transposed
        self.up_proj, self.down_proj = state.sync_weights([getattr(experts, n) for n in packed_weight_names(experts)])
        self.options = dict(num_chunks=state.config.num_chunks, gmm_backend=state.config.gmm_backend,
                            check=False)  # the counts were exchanged (and agreed) by exchange_layer_counts
        self.shared_gate_up: torch.Tensor | None = None

    def dispatch(self, x_rank_major):
        shared, counts = self.shared, self.counts
        shared_up = {}
        if shared is not None:
            gate_up_weight = torch.cat([shared.mlp.gate_proj.weight, shared.mlp.up_proj.weight])  # (2Is, H)
            shared_up = dict(shared_x=shared.x_TH, shared_weight=gate_up_weight, trans_shared_weight=True)
        h_expert_major, self.shared_gate_up, _ = alltoallv_gmm(
            x_rank_major, self.up_proj, counts.send_counts_WE, counts.recv_counts_WE, counts.group,
            trans_weight=self.trans_weight, **shared_up, **self.options,
        )
        return h_expert_major

    def experts(self, h_expert_major):
        return self.state.experts.gate_activation(h_expert_major)

    def combine(self, h_expert_major):
        shared, counts = self.shared, self.counts
        shared_down = {}
        if shared is not None:
            gate, up = self.shared_gate_up.chunk(2, dim=-1)
            shared_down = dict(shared_x=shared.mlp.act_fn(gate) * up, shared_weight=shared.mlp.down_proj.weight,
                               trans_shared_weight=True)
        return gmm_alltoallv(
            h_expert_major, self.down_proj, counts.recv_counts_WE, counts.send_counts_WE, counts.group,
            trans_weight=self.trans_weight, **shared_down, **self.options,
        )


DISPATCHERS: dict[str, type[Dispatcher]] = {"alltoallv": AllToAllDispatcher, "fused": FusedDispatcher}


def make_dispatcher(state: ExpertParallelState, counts: LayerCounts, device: torch.device,
                    shared: SharedMLP | None = None) -> Dispatcher:
    """The dispatcher of one layer call: the transport :meth:`ExpertParallelState.transport_on` names."""
    return DISPATCHERS[state.transport_on(device)](state, counts, device, shared)
