"""epmoe inside transformers' own expert parallelism: ``DistributedConfig(ep_size=N, ep_implementation="epmoe")``.

transformers' expert parallelism (``from_pretrained(path, distributed_config=DistributedConfig(ep_size=N,
fsdp_size=M, ep_implementation=name))``) routes every ``ep_dispatch_experts`` module of the model's EP
plan through the class its ``EPImplementationInterface`` registry names. ``import epmoe`` registers
:class:`EpmoeEP` there as ``"epmoe"`` (:data:`EP_IMPLEMENTATION`), so a ``DistributedConfig`` user keeps
transformers' FSDP2, Trainer, checkpoint and generate machinery and gets epmoe's data path with one
keyword::

    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(ep_size=2, fsdp_size=4, ep_implementation="epmoe")
    )

Before the first call transformers has sharded the experts ``Shard(0)`` over its ``"ep"`` mesh
(contiguous blocks: epmoe's layout), set ``experts.num_experts`` to the local count and wrapped them in
FSDP2 on its expert-FSDP mesh; during each call it swaps the DTensor weights for plain local tensors.
One :class:`EpmoeEP` per experts module runs, per call, what :mod:`epmoe.ep.layer` runs for a model
epmoe made expert-parallel, on the same pieces::

    hidden_TH, top_k_index_TK (global ids), top_k_weights_TK     transformers' router's
      position     the module's next call; its headers name it     (epmoe.ep.position)
      counts       slots per expert, rows per rank: one host read  (epmoe.ep.counts)
      dispatch     each token once per rank holding its experts    (epmoe.ep.dispatch.alltoallv)
      experts      epmoe::routed_mlp on transformers' local weight tensors (read each call, never copied)
      combine      back to the sender, summed per token in rank order
      backward     a step-header exchange first, where step checks run (on CPU by default)
    out_TH

The routing weights, the router and everything outside the experts module stay transformers', and so
do the expert gradients' reduction (FSDP2 over the expert-FSDP mesh) and their clipping. What epmoe
cannot serve raises ``ValueError`` when transformers builds the implementation (at load, on every
rank: every rank builds the same modules' implementations), naming it, never falling back to another
path: a TP mesh (``tp_size > 1``: the EP group then shares its batch, which ``"all_reduce"`` serves),
experts that are not transformers' packed experts, and experts whose class departs from the
decorated contract or holds what the routed MLP op does not run (a norm after the down projection,
parameters shared by the experts). Without transformers' ``EPImplementationInterface`` (transformers
older than 5.24) nothing is registered.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from epmoe.comm.steps import DEFAULT_TIMEOUT_S, StepChannel, checks_on
from epmoe.ep.config import ExpertShard
from epmoe.ep.contract import departures
from epmoe.ep.counts import GUARD, exchange_layer_counts
from epmoe.ep.dispatch import AllToAllVDispatcher, Link
from epmoe.ep.experts import LocalExperts
from epmoe.ep.position import LayerPosition
from epmoe.ep.recognize import is_packed_experts
from epmoe.ep.transports import static_ineligible_reason

try:
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
except ImportError:  # transformers without its own expert parallelism's registry (older than 5.24)
    EPImplementation = EPImplementationInterface = None

EP_IMPLEMENTATION = "epmoe"  # the name DistributedConfig(ep_implementation=...) gives
_ORDINALS = itertools.count()  # experts modules in the order transformers builds their implementations


def why_not_served(experts: nn.Module, tp_size: int) -> str | None:
    """Why :class:`EpmoeEP` cannot run ``experts`` under transformers' EP with a TP mesh of
    ``tp_size`` ranks (``None``: it can)."""
    if tp_size > 1:
        return (
            f"tp_size={tp_size}: the ranks of the EP group share one batch, which epmoe's per-rank exchange does "
            f"not serve; use ep_implementation='auto' (its all_reduce path) or tp_size=1"
        )
    name = type(experts).__name__
    if not is_packed_experts(experts):
        return f"{name} is not transformers' packed experts (gate_up_proj or up_proj and down_proj, decorated)"
    found = departures(experts, whole=True)
    if found:
        return f"{name} departs from the decorated experts contract: {'; '.join(found)}"
    reason = static_ineligible_reason(experts)
    if reason is not None:
        return f"{name}: {reason}"
    return None


_Base = EPImplementation if EPImplementation is not None else object


class EpmoeEP(_Base):
    """epmoe's token exchange and routed MLP for one experts module of transformers' EP plan (see
    the module docstring). Built by transformers (``__init__(experts, ep_mesh, tp_mesh)``) when it
    applies the plan; called with the batch this rank holds, global expert ids."""

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh):
        reason = why_not_served(experts, tp_mesh.size())
        if reason is not None:
            raise ValueError(f"ep_implementation={EP_IMPLEMENTATION!r}: {reason}")
        super().__init__(experts, ep_mesh, tp_mesh)
        self.experts = experts
        e, W, rank = experts.num_experts, ep_mesh.size(), ep_mesh.get_local_rank()
        # its index among the experts modules this process built implementations for, in transformers'
        # order (the same on every rank of a group that loads the same models): its headers name it
        ordinal = next(_ORDINALS)
        self.shard = ExpertShard(f"{type(experts).__name__} #{ordinal}", e * W, e, rank * e, (rank + 1) * e, rank, W)
        group = ep_mesh.get_group()
        self.channel = StepChannel(group, e + 3 + GUARD, timeout_s=DEFAULT_TIMEOUT_S) if W > 1 else None
        self.steps = LayerPosition(ordinal)
        self.transport = AllToAllVDispatcher()
        self._local: LocalExperts | None = None  # made at the first call, when the weights are local tensors

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``(T, H)``: this rank's tokens' routed experts' outputs, weighted and summed."""
        local = self._local if self._local is not None else _set_up(self)
        checks = checks_on("auto", hidden_states.device)
        return _call_eagerly(self, local, checks, hidden_states, top_k_index.long(), top_k_weights)


def _make_local(implementation: EpmoeEP) -> LocalExperts:
    """The module's :class:`~epmoe.ep.experts.LocalExperts` (its grouped-matmul backend chosen once
    per device and dtype), checked against the local weights transformers holds now."""
    experts = implementation.experts
    rows = experts.down_proj.shape[0]
    if rows != implementation.shard.num_local_experts:
        raise ValueError(
            f"ep_implementation={EP_IMPLEMENTATION!r}: {type(experts).__name__} holds {rows} experts on this rank, "
            f"num_experts says {implementation.shard.num_local_experts}"
        )
    implementation._local = LocalExperts(experts)
    return implementation._local


_set_up = torch.compiler.disable(_make_local, reason="each experts module is set up at its first call")


def _call(
    implementation: EpmoeEP,
    local: LocalExperts,
    checks: bool,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
) -> torch.Tensor:
    """One call, the layer's protocol (:func:`epmoe.ep.layer.routed_experts`) with transformers holding
    what epmoe's model record holds there: the expert gradients' reduction, the step guard."""
    shard, channel, transport = implementation.shard, implementation.channel, implementation.transport
    position = implementation.steps.next_call()
    counts = exchange_layer_counts(channel, position, shard, hidden_TH, top_k_index_TK)
    rows, meta = transport.dispatch(
        hidden_TH, top_k_index_TK, top_k_weights_TK, Link(channel, shard, position, checks, counts)
    )
    routed = meta.arrived.routed
    out_rows = local.routed_mlp(rows, routed.weights_RK, routed.pairs, sources=routed.sources)
    out_TH = transport.combine(out_rows, meta)
    return implementation.steps.backward_header(out_TH, channel, checks)


_call_eagerly = torch.compiler.disable(
    _call, reason="the counts exchange reads the counts to the host: one graph break per layer"
)


def register() -> bool:
    """Register :class:`EpmoeEP` as ``"epmoe"`` in transformers' ``EPImplementationInterface`` (models
    that name another implementation are untouched); ``False`` where transformers has no such
    registry. ``import epmoe`` calls it."""
    if EPImplementationInterface is None:
        return False
    EPImplementationInterface.register(EP_IMPLEMENTATION, EpmoeEP)
    return True
