"""One EP layer call: the protocol, in order, and the forward that replaces a packed experts module's.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the fused transport, have their forward
replaced by :mod:`epmoe.integrations.blocks`. Every one runs :func:`routed_experts`, and that runs
one call of the layer (:func:`_call`), the same steps for every transport::

    hidden_TH, top_k_index_TK, top_k_weights_TK      route: from the model's own router
      1. position   the layer's next call; its headers name it             (epmoe.ep.position)
      2. counts     the counts exchange, where the transport needs it:     (epmoe.ep.counts)
                    the one host read, the step header and guard riding along
      3. replicas   with ExpertParallelConfig(replicas=N): the call's plan, hot experts' slots
                    to ranks below the mean, from the counts every rank has (epmoe.ep.replicas)
      4. dispatch   each token to its experts' ranks (the transport: it only moves tokens)
                                                                           (epmoe.ep.dispatch)
      5. lend       with a plan: the replicas' weights from their owners, the local experts'
                    weights as the forward uses them (gradient policy, LoRA merged, compute
                    dtype), by all-to-all-v; their gradients go back in backward
                                                                           (epmoe.comm.replicas)
      6. experts    the local experts' MLP on the rows, weighted; with a plan, the lent
                    experts' on theirs too                                 (epmoe.ep.experts, .mlp)
      7. combine    back to the sender, summed per token                   (epmoe.ep.dispatch)
      8. telemetry  the call's slots per local expert, dropped slots, rows computed
                                                                           (epmoe.ep.counters)
      9. backward   its backward starts with a step-header exchange, where check_steps says so
    out_TH

A call that runs on the device alone (the transport's ``traced_whole``: a group of one, dropless,
experts that run through grouped matmuls; or the static transport without step checks at any EP
size: fixed-size buffers, no counts exchange, no host read) is traced whole by ``torch.compile``
(no graph break). Every other call runs eagerly, behind one graph break per layer (the
all-to-all-v splits are host ints). The grouped matmuls, the routed MLP and the all-to-all-v are
custom ops (``epmoe::grouped_mm``, ``epmoe::routed_mlp``, ``epmoe::all_to_all_v``), opaque to the
tracer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from epmoe.comm.replicas import lend_expert_weights
from epmoe.ep.config import DROPPED_COUNTER
from epmoe.ep.counts import LayerCounts, exchange_layer_counts
from epmoe.ep.dispatch import Arrived, Dispatcher, Link, SharedExpert
from epmoe.ep.expert_weights import WeightsHook
from epmoe.ep.experts import Replicas
from epmoe.ep.guard import check as check_guard
from epmoe.ep.replicas import ReplicaPlan, plan_replicas
from epmoe.ep.routing import RowPairs
from epmoe.ep.state import ExpertParallelState, state_of
from epmoe.gmm import GmmBackend


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
    transport = state.transport.for_call()
    _check_route(state, transport, hidden_TH, top_k_index_TK, top_k_weights_TK, shared)
    checks = state.model.checks[hidden_TH.device.type]
    call = _call if transport.traced_whole(checks) else _call_eagerly
    # the rows and pairs are built in int64 (int32 ids: grouped_mm's)
    out_TH = call(state, transport, checks, hidden_TH, top_k_index_TK.long(), top_k_weights_TK, shared)
    return out_TH.to(hidden_TH.dtype)  # experts that compute in a wider dtype are summed in it, then cast


def _call(
    state: ExpertParallelState,
    transport: Dispatcher,
    checks: bool,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    shared: SharedExpert | None,
) -> torch.Tensor:
    """One call of the layer, the protocol in order (see the module docstring)."""
    shard, channel = state.shard, state.model.channel
    position = state.steps.next_call()  # 1
    guard = _guard_values(state, hidden_TH.device)
    counts = plan = None
    if transport.needs_counts:  # 2
        key = _replica_key(state, hidden_TH.shape[1]) if state.model.links is not None else None
        counts = exchange_layer_counts(
            channel, position, shard, hidden_TH, top_k_index_TK, guard, key, transport.ranks_per_node
        )
        guard = None  # it travelled with the counts
        if key is not None and channel is not None:  # 3
            plan = _replica_plan(state, counts, key)
    hook = _weights_hook(state)
    projections, backend = _projections(state, transport, hook)
    link = Link(
        channel, shard, position, checks, counts, _capacity(state, counts), guard, projections, backend, shared, plan
    )
    rows, meta = transport.dispatch(hidden_TH, top_k_index_TK, top_k_weights_TK, link)  # 4
    arrived: Arrived = meta.arrived
    if arrived.peer_guards is not None:
        check_guard(arrived.peer_guards, position.describe(channel.layer_names))
    routed = arrived.routed
    replicas = None if plan is None else _lend(state, plan, counts, hook, routed.replica_pairs)  # 5
    if routed is None:  # 6: up-projected rows (the fused transport): the gate / activation is left
        out_rows = state.experts.gate_activation(rows)
    else:
        out_rows = state.experts.routed_mlp(
            rows, routed.weights_RK, routed.pairs, sync_weights=hook, sources=routed.sources, replicas=replicas
        )
    out_TH = transport.combine(out_rows, meta)  # 7
    state.loads.count(arrived.load_e)  # 8
    if arrived.dropped_e is not None:
        state.loads.count(arrived.dropped_e, (DROPPED_COUNTER,))
    if plan is not None:
        state.loads.count_moved(plan.moved_W())
    return state.steps.backward_header(out_TH, channel, checks)  # 9


_call_eagerly = torch.compiler.disable(
    _call, reason="the counts exchange reads the counts to the host: one graph break per layer"
)


def _replica_key(state: ExpertParallelState, hidden: int) -> tuple[int, int]:
    """What the call's replica plan takes besides the counts: the fewest slots worth moving one of its
    experts over a link inside a node and between nodes (the cost model,
    :func:`~epmoe.ep.replicas.min_rows`, at the model's :class:`~epmoe.ep.links.LinkCosts`; ``-1``:
    none), which the counts exchange checks is the same on every rank. A training step's cost model
    wherever gradients will flow to the experts' weights
    (:meth:`~epmoe.ep.experts.LocalExperts.weights_trained`), grad mode or not: a forward checkpointed
    without gradients plans as its recompute does."""
    links = state.model.links
    least = (state.experts.replica_min_rows(hidden, rho) for rho in (links.inside, links.between))
    return tuple(-1 if math.isinf(m) else math.ceil(m) for m in least)


def _replica_plan(state: ExpertParallelState, counts: LayerCounts, key: tuple[int, int]) -> ReplicaPlan | None:
    """The call's expert replicas (:func:`~epmoe.ep.replicas.plan_replicas` on the slot matrix every
    rank got in the counts exchange, ``key``, the same on every rank, and the EP ranks' nodes), ``None``
    where it moves nothing."""
    inside, between = (math.inf if k < 0 else k for k in key)
    config, links = state.model.config, state.model.links
    plan = plan_replicas(
        counts.slots_WE,
        state.shard.num_local_experts,
        config.replicas,
        inside,
        between=between,
        nodes_W=links.nodes_by_rank,
    )
    return plan if plan.moves else None


def _lend(
    state: ExpertParallelState, plan: ReplicaPlan, counts: LayerCounts, hook: WeightsHook | None, pairs: RowPairs
) -> Replicas:
    """The call's lent experts, for the rows whose ``pairs`` they run: the plan's weight exchange
    (:func:`~epmoe.comm.replicas.lend_expert_weights`, on every rank of the group) of the local
    experts' weights as the forward uses them (:meth:`~epmoe.ep.expert_weights.ExpertWeights.read`
    through the gradient policy's ``hook``: LoRA merged, in the compute dtype)."""
    weights = list(state.experts.weights.read(hook))
    own, copies = lend_expert_weights(weights, *plan.lending(state.shard.ep_rank), counts.group)
    return Replicas(own, copies, pairs)


def _guard_values(state: ExpertParallelState, device: torch.device) -> torch.Tensor | None:
    """The step guard's values this call sends (:mod:`epmoe.ep.guard`): at the first layer's forward,
    once the model runs under a data-parallel wrapper whose expert gradients epmoe finishes; never
    while ``torch.compile`` traces."""
    model = state.model
    if state.steps.layer != 0 or not model.guarded or torch.compiler.is_compiling():
        return None
    return model.guard_payload(device)


def _weights_hook(state: ExpertParallelState) -> WeightsHook | None:
    """The experts' gradient policy for this call (``state.sync_weights``), except while
    ``torch.compile`` traces a model that no data-parallel wrapper runs (none seen, no DDP or FSDP2
    around it) and whose expert gradients epmoe leaves as they are (summed by the exchanges'
    backward): nothing to hook then (:func:`epmoe.apply_expert_parallel` marked the expert
    parameters), and the policy's Python (a walk of the autograd graph, a log line) would break the
    graph."""
    model = state.model
    if torch.compiler.is_compiling() and not (model.policy.finishes or model.guarded or model.wrapped_now()):
        return None
    return state.sync_weights


def _projections(
    state: ExpertParallelState, transport: Dispatcher, hook: WeightsHook | None
) -> tuple[tuple[torch.Tensor, ...], GmmBackend | None]:
    """``(weights, backend)``: the expert weights the transport multiplies by itself, as this forward
    uses them, and their grouped-matmul backend (``((), None)`` for a transport that multiplies none)."""
    if not transport.projection_names:
        return (), None
    weights = [getattr(state.local_experts, name) for name in transport.projection_names]
    return tuple(hook(weights) if hook is not None else weights), state.experts.gmm_backend()


def _capacity(state: ExpertParallelState, counts: LayerCounts | None) -> int | None:
    """Pairs each expert keeps with ``capacity_factor`` (of the slots of every rank), ``None``: dropless."""
    factor = state.model.config.capacity_factor
    if factor is None or counts is None:
        return None
    return math.ceil(factor * counts.global_slots / state.shard.num_experts)


def _check_route(
    state: ExpertParallelState,
    transport: Dispatcher,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    shared: SharedExpert | None,
) -> None:
    """``ValueError`` / ``TypeError`` naming the layer for a route that does not fit its tokens."""
    name = state.shard.module_name
    if (
        top_k_index_TK.dim() != 2
        or top_k_index_TK.shape[0] != hidden_TH.shape[0]
        or top_k_weights_TK.shape != top_k_index_TK.shape
    ):
        raise ValueError(
            f"{name}: expected top_k_index and top_k_weights of shape (T, K) with T={hidden_TH.shape[0]}, "
            f"got {tuple(top_k_index_TK.shape)} and {tuple(top_k_weights_TK.shape)}"
        )
    if top_k_index_TK.is_floating_point() or top_k_index_TK.is_complex():
        raise TypeError(f"{name}: expected integer top_k_index, got {top_k_index_TK.dtype}")
    if shared is not None and not transport.carries_shared:
        raise ValueError(f"{name}: the {transport.name!r} transport leaves a shared expert to the block")
    if hidden_TH.device.type == "meta":
        raise ValueError(
            f"{name}: the hidden states are on the meta device: an EP model cannot run before its "
            f"weights exist (load them with epmoe.from_pretrained, or to_empty() then load a state dict)"
        )


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH = routed_experts(state_of(module), hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
