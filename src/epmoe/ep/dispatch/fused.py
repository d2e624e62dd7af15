"""The fused transport: the vendor ops' per-slot layout, the experts' MLP split across the fused ops.

One row per slot (token, k), sorted by global expert on the sender and weighted there, so the
router gets its gradient; ``alltoallv_gmm`` runs the exchange and the up projection, the experts'
gate runs between, ``gmm_alltoallv`` runs the down projection and the exchange back (their row
orders: :mod:`epmoe.comm.layout`). A block's shared expert (:class:`~epmoe.ep.dispatch.base.SharedExpert`)
rides in the fused ops' communication gaps: ``x @ [gate; up]`` beside the up projection, ``h_s @ down``
beside the down projection::

    slots (t, k) --sort by expert (SlotOrder)--> rank-major rows   [t0k0->g0  t1k1->g0 | t0k1->g3 ...]
      --alltoallv_gmm (exchange, then up projection)--> h expert-major on the experts' ranks
      --gate / activation--> a
      --gmm_alltoallv (down projection, then exchange)--> rank-major rows back on the sender
      --weight, unsort, sum each token's K rows--> out_TH   (+ the shared expert's output, gated)

Only for experts :func:`~epmoe.ep.recognize.fused_ineligible_reason` accepts (packed, no bias, no
post-expert norm); the layer hands it their two projections as this forward uses them
(``link.projections``) and runs the experts' gate / activation between the two ops. The per-slot helpers (:class:`SlotOrder`, :func:`permute_tokens`,
:func:`unpermute_and_combine`) build every index on the device (no host read: ``torch.compile``
traces them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv
from epmoe.comm.layout import inverse_permutation
from epmoe.ep.counts import LayerCounts
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, SharedExpert
from epmoe.gmm import GmmBackend


@dataclass(frozen=True)
class SlotOrder:
    """This rank's slots sorted by global expert, on the device: the fused transport's per-slot rows."""

    sort_S: torch.Tensor  # slot ids in rank-major order (sorted by global expert, stable)
    unsort_S: torch.Tensor  # inverse of sort_S


def sort_slots(top_k_index_TK: torch.Tensor) -> SlotOrder:
    """This rank's slots sorted by global expert (stable)."""
    sort_S = torch.sort(top_k_index_TK.reshape(-1), stable=True).indices
    return SlotOrder(sort_S, inverse_permutation(sort_S))


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


@dataclass(frozen=True)
class FusedMeta:
    """One call of :class:`FusedDispatcher`: what :meth:`~FusedDispatcher.combine` reads."""

    arrived: Arrived
    counts: LayerCounts
    slots: SlotOrder
    hidden_TH: torch.Tensor  # the call's tokens (the shared expert's gate reads them)
    top_k_weights_TK: torch.Tensor
    down_proj: torch.Tensor  # the down projection as this forward uses it (link.projections)
    gmm_backend: GmmBackend  # the experts' grouped-matmul backend, both projections
    shared: SharedExpert | None
    shared_gate_up: torch.Tensor | None  # (T, 2 Is) the shared expert's gate / up output, where it has one


class FusedDispatcher(Dispatcher):
    """``alltoallv_gmm`` (up projection), then (the layer's) the experts' gate / activation, then
    ``gmm_alltoallv`` (down projection), on the per-slot rows (see the module docstring).
    ``projection_names``: the experts' (up or gate_up, down) weights, no bias; ``trans_weight``:
    whether they are stored ``(E, out, in)`` (``nn.Linear``'s layout, our "transposed")."""

    name = "fused"
    carries_shared = True

    def __init__(self, projection_names: tuple[str, str], *, trans_weight: bool, num_chunks: int):
        self.projection_names, self.trans_weight = projection_names, trans_weight
        self.options = dict(num_chunks=num_chunks, check=False)  # the counts were exchanged (and agreed) by the layer

    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, FusedMeta]:
        """``(h, meta)``: the up projection's output on the experts' ranks, expert-major."""
        counts, shared = link.counts, link.shared
        up_proj, down_proj = link.projections
        slots = sort_slots(top_k_index_TK)
        x_rank_major = permute_tokens(hidden_TH, slots, top_k_index_TK.shape[1])
        shared_up = {}
        if shared is not None:
            gate_up_weight = torch.cat([shared.mlp.gate_proj.weight, shared.mlp.up_proj.weight])  # (2Is, H)
            shared_up = dict(shared_x=hidden_TH, shared_weight=gate_up_weight, trans_shared_weight=True)
        h_expert_major, shared_gate_up, _ = alltoallv_gmm(
            x_rank_major,
            up_proj,
            counts.send_counts_WE,
            counts.recv_counts_WE,
            counts.group,
            trans_weight=self.trans_weight,
            gmm_backend=link.gmm_backend,
            **shared_up,
            **self.options,
        )
        arrived = Arrived(None, counts.local_counts_e, peer_guards=counts.peer_guards)
        meta = FusedMeta(
            arrived, counts, slots, hidden_TH, top_k_weights_TK, down_proj, link.gmm_backend, shared, shared_gate_up
        )
        return h_expert_major, meta

    def combine(self, a_expert_major: torch.Tensor, meta: FusedMeta) -> torch.Tensor:
        """``(T, H)``: the down projection, the rows back, weighted and summed per token; plus the
        shared expert's output (times its gate) where one was given."""
        counts, shared = meta.counts, meta.shared
        shared_down = {}
        if shared is not None:
            gate, up = meta.shared_gate_up.chunk(2, dim=-1)
            shared_down = dict(
                shared_x=shared.mlp.act_fn(gate) * up,
                shared_weight=shared.mlp.down_proj.weight,
                trans_shared_weight=True,
            )
        y_rank_major, shared_TH = gmm_alltoallv(
            a_expert_major,
            meta.down_proj,
            counts.recv_counts_WE,
            counts.send_counts_WE,
            counts.group,
            trans_weight=self.trans_weight,
            gmm_backend=meta.gmm_backend,
            **shared_down,
            **self.options,
        )
        out_TH = unpermute_and_combine(y_rank_major, meta.top_k_weights_TK, meta.slots, meta.hidden_TH.dtype)
        if shared is None:
            return out_TH
        if shared.gate is not None:
            shared_TH = torch.sigmoid(shared.gate(meta.hidden_TH)) * shared_TH
        return out_TH + shared_TH
