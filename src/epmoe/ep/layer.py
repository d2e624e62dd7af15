"""The routed path of an EP layer, and the forward that replaces a packed experts module's.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the fused transport, have their forward
replaced by :mod:`epmoe.integrations.blocks`. Every one runs :func:`routed_experts`, which hands the
tokens to the layer's dispatcher (``state.transport``, :mod:`epmoe.ep.dispatch`)::

    hidden_TH, top_k_index_TK, top_k_weights_TK      route: from the model's own router
      -> dispatch   counts exchange (the one host read, the step header riding along), then each
                    token to its experts' ranks          (epmoe.ep.dispatch.base, .alltoallv / .fused)
      -> experts    the local experts' MLP, weighted     (epmoe.ep.experts, epmoe.ep.mlp)
      -> combine    back to the sender, summed per token (epmoe.ep.dispatch.alltoallv / .fused)
    out_TH

A call that runs on the device alone (:meth:`~epmoe.ep.dispatch.base.Dispatcher.traced_whole`: a
group of one, dropless, all-to-all-v, experts that run through grouped matmuls) has nothing to
exchange: the tokens are the rows, the pairs are built on the device, and the grouped matmuls take
their counts there: no host read at all where the backend takes device offsets, and
``torch.compile`` traces the call whole (no graph break). So does the static transport without step
checks at any EP size (:mod:`epmoe.ep.dispatch.static`: fixed-size buffers, no counts exchange, no
host read). Every other call runs eagerly, behind one graph break per layer (the all-to-all-v splits
are host ints). The grouped matmuls, the routed MLP
and the all-to-all-v are custom ops (``epmoe::grouped_mm``, ``epmoe::routed_mlp``,
``epmoe::all_to_all_v``), opaque to the tracer.

Each forward that exchanges counts is the layer's next *call*; its backward starts with a step-header
exchange (where ``check_steps`` says so), before the layer's backward exchanges (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.dispatch import Dispatcher, SharedExpert
from epmoe.ep.state import ExpertParallelState, state_of


def routed_experts(
    state: ExpertParallelState,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """``(T, H)``: every token's routed experts' outputs, weighted and summed (plus the shared
    expert's, where one is given: only to a transport that carries it, overlapped with its
    communication)."""
    shard, transport = state.shard, state.transport
    if (
        top_k_index_TK.dim() != 2
        or top_k_index_TK.shape[0] != hidden_TH.shape[0]
        or top_k_weights_TK.shape != top_k_index_TK.shape
    ):
        raise ValueError(
            f"{shard.module_name}: expected top_k_index and top_k_weights of shape (T, K) with T={hidden_TH.shape[0]}, "
            f"got {tuple(top_k_index_TK.shape)} and {tuple(top_k_weights_TK.shape)}"
        )
    if top_k_index_TK.is_floating_point() or top_k_index_TK.is_complex():
        raise TypeError(f"{shard.module_name}: expected integer top_k_index, got {top_k_index_TK.dtype}")
    top_k_index_TK = top_k_index_TK.long()  # the rows and pairs are built in int64 (int32 ids: grouped_mm's)
    if shared is not None and not transport.carries_shared:
        raise ValueError(f"{shard.module_name}: the {transport.name!r} transport leaves a shared expert to the block")
    if hidden_TH.device.type == "meta":
        raise ValueError(
            f"{shard.module_name}: the hidden states are on the meta device: an EP model cannot run before its "
            f"weights exist (load them with epmoe.from_pretrained, or to_empty() then load a state dict)"
        )
    route = _route if transport.traced_whole(state) else _route_eagerly
    out_TH = route(transport, state, hidden_TH, top_k_index_TK, top_k_weights_TK, shared)
    return out_TH.to(hidden_TH.dtype)  # experts that compute in a wider dtype are summed in it, then cast


def _route(
    transport: Dispatcher,
    state: ExpertParallelState,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    shared: SharedExpert | None,
) -> torch.Tensor:
    """Dispatch, experts, combine."""
    rows, meta = transport.dispatch(state, hidden_TH, top_k_index_TK, top_k_weights_TK, shared)
    return transport.combine(state, transport.experts(state, rows, meta), meta)


_route_eagerly = torch.compiler.disable(
    _route, reason="the counts exchange reads the counts to the host: one graph break per layer"
)


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH = routed_experts(state_of(module), hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
