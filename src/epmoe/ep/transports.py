"""A layer's transport, chosen and built from its experts module when EP is applied.

The transports (:mod:`epmoe.ep.dispatch`) only move tokens; what they must know of the experts
module is read here, once: whether the static exchange can run it, the fused transport's
projections and their layout, whether a call can run on the device alone.
"""

from __future__ import annotations

from torch import nn

from epmoe.ep.config import ExpertParallelConfig, ExpertShard
from epmoe.ep.dispatch import (
    AllToAllVDispatcher,
    DecodeDispatcher,
    Dispatcher,
    FusedDispatcher,
    NodeGroups,
    NodesDispatcher,
    StaticDispatcher,
)
from epmoe.ep.expert_weights import packed_weight_names
from epmoe.ep.experts import LocalExperts
from epmoe.ep.recognize import linear_triples, per_expert_post, shared_parameters, weights_transposed
from epmoe.ep.topology import NodeLayout

TRANSPORTS = ("alltoallv", "fused", "static", "nodes")  # the ExpertParallelConfig.dispatch values a layer runs


def make_dispatcher(
    name: str,
    shard: ExpertShard,
    local: LocalExperts,
    config: ExpertParallelConfig,
    nodes: tuple[NodeLayout, NodeGroups] | None = None,
) -> Dispatcher:
    """The dispatcher of transport ``name`` (one of :data:`TRANSPORTS`) for the local experts
    ``local`` of the slice ``shard``, built once per layer; ``nodes``: the EP group's node layout and
    this rank's groups of the two-level exchange (``"nodes"``)."""
    if name == "alltoallv":
        on_device = shard.ep_size == 1 and config.capacity_factor is None and local.weights.grouped
        return AllToAllVDispatcher(on_device=on_device)
    if name == "fused":
        names = tuple(packed_weight_names(local.module))  # (up or gate_up, down): no bias
        # nn.Linear's layout (E, out, in) is our "transposed"
        return FusedDispatcher(names, trans_weight=not weights_transposed(local.module), num_chunks=config.num_chunks)
    if name == "static":
        return StaticDispatcher(config.static_tokens)
    if name == "nodes":
        return NodesDispatcher(*nodes)
    raise ValueError(f"make_dispatcher(name): {name!r} is not one of {list(TRANSPORTS)}")


def static_ineligible_reason(experts: nn.Module) -> str | None:
    """Why the static transport cannot run ``experts`` (``None``: it can): it needs the routed MLP
    op, whose grouped matmuls take device counts (packed experts without a norm after the down
    projection, or ``nn.ModuleList`` experts of Linear triples)."""
    if isinstance(experts, nn.ModuleList):
        if linear_triples(experts) is None:
            return "its experts run their own forwards, which slice their rows by counts read to the host"
        return None
    if getattr(experts, "has_post_expert_norm", False) or per_expert_post(experts) is not None:
        return "a norm after the down projection runs outside the routed MLP op"
    if shared_parameters(experts):
        return "parameters shared by every expert run outside the routed MLP op"
    return None


def decode_dispatcher(prompt: Dispatcher) -> DecodeDispatcher:
    """``prompt`` at a generate call's first forward, a static exchange reading its route headers at
    every decode step after it (a fresh buffer, agreed at the first decode step)."""
    return DecodeDispatcher(prompt, StaticDispatcher(read_headers=True))
