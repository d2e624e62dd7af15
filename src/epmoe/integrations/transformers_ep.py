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
      telemetry    the call's slots per local expert                (epmoe.ep.counters: epmoe.expert_load)
      backward     a step-header exchange first, where step checks run (on CPU by default)
    out_TH

At inference (no gradient through the tokens: ``generate``, evaluation) the static exchange runs
instead (:mod:`epmoe.ep.dispatch.static`: the route rides with the rows, two collectives instead of
three, no counts exchange): its buffer is re-agreed from the route headers every rank reads and
fitted to each forward's largest batch, so the decode steps after a prompt exchange decode-sized
buffers. Only the model's first experts module reads them (one host read per forward, not per
layer): the later layers of the forward hold the same tokens and take its buffer, reading nothing
(where ``check_steps`` runs, the CPU default, every layer reads its headers to check them). With
``ExpertParallelConfig(dispatch="static", static_tokens=N)`` the buffer is ``N`` and nothing is read
to the host (sync-free, training included). Where the EP group spans nodes (:mod:`epmoe.ep.topology`:
torchrun's environment, or ``ranks_per_node``), training steps take the two-level exchange
(:mod:`epmoe.ep.dispatch.nodes`; with ``dispatch="nodes"`` inference too), its groups made once per
EP group.

With a TP mesh (``tp_size > 1``) the ranks of a TP group hold the same batch. Where the EP group is
the TP group (``ep_size == tp_size``: transformers' ``shares_batch``), nothing needs to move: the
shared-batch transport (:mod:`epmoe.ep.dispatch.shared`) runs each rank's experts on the batch's
pairs routed to them and one all-reduce sums the partial outputs, in training and at inference, no
host read (but the step check's batch sizes, where ``check_steps`` runs), where transformers'
``"all_reduce"`` pushes the masked routes through its experts too. Where the EP group spans several
TP groups (or ``dispatch`` names ``"alltoallv"`` / ``"static"``), each TP rank takes its slice of the
shared batch (``Replicate`` to ``Shard(0)``: a local chunk), the per-rank exchange runs on the
slices, and the slices' outputs are gathered over TP, as transformers' ``"all_to_all"`` does.

The routing weights, the router and everything outside the experts module stay transformers', and so
do the expert gradients' reduction (FSDP2 over the expert-FSDP mesh) and their clipping. An
:class:`~epmoe.ExpertParallelConfig` given to :func:`register` (``register("mine", config)``, then
``ep_implementation="mine"``) sets what it can here: ``dispatch`` (``"auto"`` above, ``"alltoallv"``
always, ``"static"`` always), ``static_tokens``, ``gmm_backend``, ``check_steps``, ``timeout``. What
epmoe cannot serve raises ``ValueError`` when transformers builds the implementation (at load, on
every rank: every rank builds the same modules' implementations), naming it, never falling back to
another path: ``capacity_factor``, expert ``replicas`` (their weights would travel as transformers'
FSDP2 shards, whose gradients transformers reduces), the fused ops (``dispatch="fused"``, ``num_chunks``),
an
``expert_grad`` other than ``"auto"`` (the expert gradients are transformers' FSDP2's), experts that
are not transformers' packed experts, and experts whose class departs from the
decorated contract or holds what the routed MLP op does not run (a norm after the down projection,
parameters shared by the experts). Without transformers' ``EPImplementationInterface`` (transformers
older than 5.24) nothing is registered.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from epmoe.comm.steps import DEFAULT_TIMEOUT_S, StepChannel, checks_on
from epmoe.ep.config import ExpertParallelConfig, ExpertShard
from epmoe.ep.contract import departures
from epmoe.ep.counters import LoadCounters, attach_counted
from epmoe.ep.counts import CountsRow, exchange_layer_counts
from epmoe.ep.dispatch import (
    AllToAllVDispatcher,
    Dispatcher,
    Link,
    NodeGroups,
    NodesDispatcher,
    SharedBatchDispatcher,
    StaticDispatcher,
)
from epmoe.ep.experts import LocalExperts
from epmoe.ep.position import LayerPosition
from epmoe.ep.recognize import is_packed_experts
from epmoe.ep.topology import NodeLayout, nodes_of_ranks, two_level_layout
from epmoe.ep.transports import static_ineligible_reason
from epmoe.integrations.releases import untested_release

try:
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface
except ImportError:  # transformers without its own expert parallelism's registry (older than 5.24)
    EPImplementation = EPImplementationInterface = None

EP_IMPLEMENTATION = "epmoe"  # the name DistributedConfig(ep_implementation=...) gives
_ORDINALS = itertools.count()  # experts modules in the order transformers builds their implementations
# (id(model config), id(EP group)) -> the static exchange of that model's first experts module on that
# group: the layer whose forward reads the route headers for the later ones (weak: gone with the model)
_LEADERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# EP group -> {node layout: its two-level exchange's groups}, made once (weak: gone with the group, so a
# later group never finds a dead one's subgroups)
_NODE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def why_not_served(experts: nn.Module, config: ExpertParallelConfig | None = None) -> str | None:
    """Why :class:`EpmoeEP` cannot run ``experts`` under transformers' EP with ``config`` (``None``: it can)."""
    config = config or ExpertParallelConfig()
    release = untested_release()
    if release is not None:
        return release
    refused = {
        "capacity_factor": config.capacity_factor is not None,
        "dispatch": config.dispatch == "fused",
        "num_chunks": config.num_chunks != "auto",
        "expert_grad": config.expert_grad != "auto",
        "replicas": config.replicas > 0,
    }
    option = next((option for option, asked in refused.items() if asked), None)
    if option is not None:
        return (
            f"ExpertParallelConfig({option}={getattr(config, option)!r}) is not served inside transformers' "
            f"expert parallelism (it runs the all-to-all-v or the static exchange, dropless, and transformers' "
            f"FSDP2 reduces the expert gradients); use epmoe.from_pretrained or apply_expert_parallel for it"
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
    applies the plan; called with the batch this rank holds, global expert ids. ``config``: what
    :func:`register` bound the registered name to."""

    config = ExpertParallelConfig()
    registered_as = EP_IMPLEMENTATION

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh):
        reason = why_not_served(experts, self.config)
        if reason is not None:
            raise ValueError(f"ep_implementation={self.registered_as!r}: {reason}")
        super().__init__(experts, ep_mesh, tp_mesh)
        self.experts = experts
        e, W, rank = experts.num_experts, ep_mesh.size(), ep_mesh.get_local_rank()
        # its index among the experts modules this process built implementations for, in transformers'
        # order (the same on every rank of a group that loads the same models): its headers name it
        ordinal = next(_ORDINALS)
        self.shard = ExpertShard(f"{type(experts).__name__} #{ordinal}", e * W, e, rank * e, (rank + 1) * e, rank, W)
        timeout = self.config.timeout or DEFAULT_TIMEOUT_S
        nodes = _two_level(self.config, ep_mesh.get_group(), rank, W, self.shares_batch, timeout)
        width = CountsRow(e, ranks_per_node=nodes.ranks_per_node if nodes is not None else 0).width
        self.channel = StepChannel(ep_mesh.get_group(), width, timeout_s=timeout) if W > 1 else None
        self.steps = LayerPosition(ordinal)
        # transformers' own reading of its meshes: the EP group is the TP group, every rank holds the same batch
        # the model's first experts module on this group leads its forwards' static buffer
        model_on_group = (id(getattr(experts, "config", experts)), id(ep_mesh.get_group()))
        self.training, self.inference = _transports(self.config, self.shares_batch, _LEADERS.get(model_on_group))
        if nodes is not None:  # across nodes: the two-level exchange in training (and at inference, if asked)
            self.training = nodes
            self.inference = nodes if self.config.dispatch == "nodes" else self.inference
        if isinstance(self.inference, StaticDispatcher):
            _LEADERS.setdefault(model_on_group, self.inference)
        # a TP group shares a batch that the per-rank exchange must see once: each TP rank sends its slice
        self.sliced = tp_mesh.size() > 1 and not isinstance(self.training, SharedBatchDispatcher)
        self.loads = LoadCounters(e)  # read by epmoe.expert_load, which finds them on the experts module
        attach_counted(experts, self)
        self._local: LocalExperts | None = None  # made at the first call, when the weights are local tensors

    @property
    def device(self) -> torch.device:
        """Where this rank's experts are (and the EP group's exchanges run)."""
        return next(self.experts.parameters()).device

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """``(T, H)``: this rank's tokens' routed experts' outputs, weighted and summed."""
        local = self._local if self._local is not None else _set_up(self)
        trained = torch.is_grad_enabled() and hidden_states.requires_grad
        transport = self.training if trained else self.inference
        checks = checks_on(self.config.check_steps, hidden_states.device)
        call = _call if transport.traced_whole(checks) else _call_eagerly
        if not self.sliced:
            return call(self, local, transport, checks, hidden_states, top_k_index.long(), top_k_weights)
        route = (_tp_slice(t, self.tp_mesh) for t in (hidden_states, top_k_index.long(), top_k_weights))
        return _tp_gathered(call(self, local, transport, checks, *route), self.tp_mesh, hidden_states.shape[0])


def _two_level(config: ExpertParallelConfig, group, rank: int, W: int, shares_batch: bool, timeout: float):
    """The two-level exchange (:mod:`epmoe.ep.dispatch.nodes`) where the one decision
    (:func:`~epmoe.ep.topology.two_level_layout`) has the EP group run it, its groups made once per EP
    group; ``None`` elsewhere. Collective over the EP group (every rank builds the same implementations)."""
    if W == 1 or shares_batch or config.dispatch not in ("auto", "nodes"):
        return None
    layout = two_level_layout(config, nodes_of_ranks(config, group, W, timeout), rank)
    return NodesDispatcher(layout, node_groups(group, layout, rank, timeout)) if layout is not None else None


def node_groups(group, layout: NodeLayout, rank: int, timeout: float) -> NodeGroups:
    """This rank's groups of the two-level exchange over ``layout`` of the EP ``group``, made at the
    first call for that group and layout (collective over ``group`` then), the same object after; held
    as long as ``group`` lives (a group made later never finds a dead group's subgroups)."""
    made = _NODE_GROUPS.setdefault(group, {})
    if layout not in made:
        made[layout] = NodeGroups.make(group, layout, rank, timeout)
    return made[layout]


def _transports(
    config: ExpertParallelConfig, shares_batch: bool, leader: StaticDispatcher | None
) -> tuple[Dispatcher, Dispatcher]:
    """``(training, inference)``: the transports a call takes with and without gradients through its
    tokens, for ``config.dispatch`` and an EP group that ``shares_batch`` or not; ``leader``: the
    static exchange of the model's first experts module on this group, ``None`` where this is it
    (see the module docstring)."""
    if shares_batch and config.dispatch == "auto":
        shared = SharedBatchDispatcher()
        return shared, shared
    if config.dispatch == "alltoallv":
        return AllToAllVDispatcher(), AllToAllVDispatcher()
    agreed = config.static_tokens is None  # else fixed: nothing is read
    static = StaticDispatcher(config.static_tokens, read_headers=agreed and leader is None, fit=True, leader=leader)
    if config.dispatch == "static":
        return static, static
    return AllToAllVDispatcher(), static


def _make_local(implementation: EpmoeEP) -> LocalExperts:
    """The module's :class:`~epmoe.ep.experts.LocalExperts` (its grouped-matmul backend chosen once
    per device and dtype), checked against the local weights transformers holds now."""
    experts = implementation.experts
    rows = experts.down_proj.shape[0]
    if rows != implementation.shard.num_local_experts:
        raise ValueError(
            f"ep_implementation={implementation.registered_as!r}: {type(experts).__name__} holds {rows} experts on "
            f"this rank, num_experts says {implementation.shard.num_local_experts}"
        )
    implementation._local = LocalExperts(experts, implementation.config.gmm_backend)
    return implementation._local


_set_up = torch.compiler.disable(_make_local, reason="each experts module is set up at its first call")


def _call(
    implementation: EpmoeEP,
    local: LocalExperts,
    transport: Dispatcher,
    checks: bool,
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
) -> torch.Tensor:
    """One call, the layer's protocol (:func:`epmoe.ep.layer.routed_experts`) with transformers holding
    what epmoe's model record holds there: the expert gradients' reduction, the step guard."""
    shard, channel = implementation.shard, implementation.channel
    position = implementation.steps.next_call()
    counts = None
    if transport.needs_counts:
        counts = exchange_layer_counts(
            channel, position, shard, hidden_TH, top_k_index_TK, None, None, transport.ranks_per_node
        )
    link = Link(channel, shard, position, checks, counts)
    rows, meta = transport.dispatch(hidden_TH, top_k_index_TK, top_k_weights_TK, link)
    routed = meta.arrived.routed
    out_rows = local.routed_mlp(rows, routed.weights_RK, routed.pairs, sources=routed.sources)
    out_TH = transport.combine(out_rows, meta)
    implementation.loads.count(meta.arrived.load_e)
    return implementation.steps.backward_header(out_TH, channel, checks)


_call_eagerly = torch.compiler.disable(
    _call, reason="the counts exchange reads the counts to the host: one graph break per layer"
)


def _tp_slice(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's rows of ``x``, which every rank of the TP group holds alike (``Replicate`` to
    ``Shard(0)``: a local chunk, no communication; its backward all-gathers the rows' gradients)."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()


def _tp_gathered(out_tH: torch.Tensor, tp_mesh, num_tokens: int) -> torch.Tensor:
    """``(T, H)``: the TP ranks' slices of the output gathered (uneven or empty ones too), on every rank."""
    H = out_tH.shape[1]
    sliced = DTensor.from_local(out_tH.contiguous(), tp_mesh, [Shard(0)], shape=(num_tokens, H), stride=(H, 1))
    return sliced.full_tensor()


def register(name: str = EP_IMPLEMENTATION, config: ExpertParallelConfig | dict | None = None) -> bool:
    """Register :class:`EpmoeEP` as ``name`` in transformers' ``EPImplementationInterface``, bound to
    ``config`` (an :class:`~epmoe.ExpertParallelConfig`, a dict of its fields, or ``None``: the
    defaults), so ``DistributedConfig(ep_implementation=name)`` runs it; models that name another
    implementation are untouched. ``False`` where transformers has no such registry. ``import epmoe``
    calls ``register()``; what the config asks that cannot be served raises at load."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register(name): expected a non-empty str, got {name!r}")
    bound = ExpertParallelConfig.from_any(config)
    if EPImplementationInterface is None:
        return False
    if name == EP_IMPLEMENTATION and bound == EpmoeEP.config:
        cls = EpmoeEP
    else:
        cls = type(EpmoeEP.__name__, (EpmoeEP,), {"config": bound, "registered_as": name})
    EPImplementationInterface.register(name, cls)
    return True
