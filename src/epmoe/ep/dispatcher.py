"""Dispatch and combine: how a layer's tokens reach their local experts and come back.

One interface, one class per transport (``ExpertParallelConfig.dispatch`` names the transport)::

    hidden_TH, top_k_index_TK, top_k_weights_TK --dispatch--> rows on the experts' ranks
      --experts--> their outputs --combine--> (out_TH, shared_TH)

Both take the layer's :class:`LayerCounts` (its counts already exchanged); the step headers stay with
:func:`epmoe.ep.layer.routed_experts`.

* :class:`AllToAllDispatcher`: each token once per rank holding one of its experts
  (:mod:`epmoe.ep.routing`'s rows), its expert ids and routing weights beside it; on the expert's
  rank the rows expand to their local experts by index, run ``epmoe::routed_mlp`` (with
  ``capacity_factor``, each expert's first pairs only) and come back weighted and summed, one row
  per (token, rank); the sender sums each token's rows in rank order::

      tokens --gather--> rows (token, rank) --all-to-all-v--> rows (source, token) --routed MLP-->
      one row per (source, token) --all-to-all-v--> rows (token, rank) --sum per token--> tokens

  With a group of one the rows are the tokens: nothing moves. Every index is built on the device
  from the routing and the exchanged counts.

* :class:`FusedDispatcher`: the vendor ops' per-slot layout (one row per (token, expert), sorted by
  expert, weighted on the sender), the MLP split across the fused ops, a shared expert's matmuls
  (where the block has one they can carry, :class:`SharedMLP`) in their communication gaps::

      slots --alltoallv_gmm(up)--> h expert-major --gate / activation--> h
            --gmm_alltoallv(down)--> slots --weight, sum per token--> tokens   shared: x @ [gate; up], then h_s @ down

:func:`make_dispatcher` picks the class for a call from the state's transport and the call's device.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from epmoe.comm import all_to_all_v
from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv
from epmoe.ep.config import DROPPED_COUNTER
from epmoe.ep.experts import packed_weight_names
from epmoe.ep.routing import (
    LayerCounts,
    RowPairs,
    TokenRows,
    gather_rows,
    keep_first,
    pair_rows,
    permute_tokens,
    sort_slots,
    sum_rows,
    token_rows,
    unpermute_and_combine,
)
from epmoe.ep.state import ExpertParallelState


@dataclass(frozen=True)
class SharedMLP:
    """A block's shared expert ``down(act_fn(gate(x)) * up(x))`` of bias-free Linears, on ``x_TH``."""

    mlp: nn.Module
    x_TH: torch.Tensor


@dataclass
class LocalRows:
    """What :meth:`AllToAllDispatcher.dispatch` hands the local experts: rows, their routing weights,
    and the pairs they expand to."""

    x_RH: torch.Tensor
    weights_RK: torch.Tensor
    pairs: RowPairs


class Dispatcher(ABC):
    """One layer call's transport (see the module docstring). ``shared``: a shared expert the
    transport computes alongside (``None``: the block computes its own)."""

    def __init__(self, state: ExpertParallelState, counts: LayerCounts, device: torch.device,
                 shared: SharedMLP | None = None):
        self.state, self.counts, self.device, self.shared = state, counts, device, shared

    @abstractmethod
    def dispatch(self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor):
        """The tokens to their experts' ranks: what :meth:`experts` reads."""

    @abstractmethod
    def experts(self, dispatched):
        """What the local experts compute between :meth:`dispatch` and :meth:`combine`."""

    @abstractmethod
    def combine(self, computed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out_TH, shared_TH or None)``: each token's experts' outputs, weighted and summed."""


class AllToAllDispatcher(Dispatcher):
    """Each token once per rank holding its experts, all-to-all-v around ``epmoe::routed_mlp`` (a
    shared expert, if given, runs on its own)."""

    rows: TokenRows | None = None  # the sender's rows (None on a single rank: the tokens themselves)

    def dispatch(self, hidden_TH, top_k_index_TK, top_k_weights_TK):
        state, counts = self.state, self.counts
        shard = state.shard
        e, K = shard.num_local_experts, top_k_index_TK.shape[1]
        if counts.ep_size == 1:
            x_RH, weights_RK, local_expert_RK = hidden_TH, top_k_weights_TK, top_k_index_TK
        else:
            rows = self.rows = token_rows(top_k_index_TK, e, counts.ep_size, sum(counts.send_rows_W))
            # each row's K expert ids and weights travel beside it, in one exchange (ids exact in it)
            route_dtype = torch.float64 if top_k_weights_TK.dtype == torch.float64 else torch.float32
            route_RK2 = torch.cat([top_k_index_TK.to(route_dtype), top_k_weights_TK.to(route_dtype)], dim=1)
            splits = (counts.recv_rows_W, counts.send_rows_W, counts.group)
            x_RH = all_to_all_v(gather_rows(hidden_TH, rows), *splits)
            route_RK2 = all_to_all_v(route_RK2[rows.token_R], *splits)
            local_expert_RK = route_RK2[:, :K].long() - shard.local_start
            local_expert_RK = local_expert_RK.masked_fill((local_expert_RK < 0) | (local_expert_RK >= e), e)
            weights_RK = route_RK2[:, K:].to(top_k_weights_TK.dtype)
        host_counts = counts.local_counts_e
        pairs = pair_rows(local_expert_RK, e, sum(host_counts), host_counts)
        factor = state.config.capacity_factor
        if factor is not None:
            pairs, dropped = keep_first(pairs, math.ceil(factor * counts.global_slots / shard.num_experts),
                                        host_counts)
            state.count_load(dropped, (DROPPED_COUNTER,))
        return LocalRows(x_RH, weights_RK, pairs)

    def experts(self, local: LocalRows):
        """The local experts on their rows' pairs, weighted and summed per row; with
        ``config.capacity_factor``, only each expert's first ``C`` pairs (the global order: source
        rank, then token, then k), the others' outputs zero and counted as dropped (see
        :class:`~epmoe.ep.config.ExpertParallelConfig`)."""
        return self.state.experts.routed_mlp(local.x_RH, local.weights_RK, local.pairs,
                                             sync_weights=self.state.sync_weights)

    def combine(self, y_RH):
        shared_TH = None if self.shared is None else self.shared.mlp(self.shared.x_TH)
        counts = self.counts
        if counts.ep_size == 1:
            return y_RH, shared_TH
        back_RH = all_to_all_v(y_RH, counts.send_rows_W, counts.recv_rows_W, counts.group)
        return sum_rows(back_RH, self.rows), shared_TH


class FusedDispatcher(Dispatcher):
    """``alltoallv_gmm`` (up projection), the experts' gate / activation, ``gmm_alltoallv`` (down
    projection), on the per-slot rows; the shared expert rides in their gaps. Only for experts
    :func:`~epmoe.ep.recognize.fused_ineligible_reason` accepts (packed, no bias, no post-expert norm)."""

    def __init__(self, state, counts, device, shared=None):
        super().__init__(state, counts, device, shared)
        experts = state.local_experts
        self.trans_weight = not experts.is_transposed
        self.up_proj, self.down_proj = state.sync_weights([getattr(experts, n) for n in packed_weight_names(experts)])
        self.options = dict(num_chunks=state.config.num_chunks, gmm_backend=state.experts.gmm_backend(),
                            check=False)  # the counts were exchanged (and agreed) by exchange_layer_counts
        self.shared_gate_up: torch.Tensor | None = None

    def dispatch(self, hidden_TH, top_k_index_TK, top_k_weights_TK):
        shared, counts = self.shared, self.counts
        self.slots, self.weights_TK, self.dtype = sort_slots(top_k_index_TK), top_k_weights_TK, hidden_TH.dtype
        x_rank_major = permute_tokens(hidden_TH, self.slots, top_k_index_TK.shape[1])
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
        y_rank_major, shared_TH = gmm_alltoallv(
            h_expert_major, self.down_proj, counts.recv_counts_WE, counts.send_counts_WE, counts.group,
            trans_weight=self.trans_weight, **shared_down, **self.options,
        )
        return unpermute_and_combine(y_rank_major, self.weights_TK, self.slots, self.dtype), shared_TH


DISPATCHERS: dict[str, type[Dispatcher]] = {"alltoallv": AllToAllDispatcher, "fused": FusedDispatcher}


def make_dispatcher(state: ExpertParallelState, counts: LayerCounts, device: torch.device,
                    shared: SharedMLP | None = None) -> Dispatcher:
    """The dispatcher of one layer call: the transport :meth:`ExpertParallelState.transport_on` names."""
    return DISPATCHERS[state.transport_on(device)](state, counts, device, shared)
