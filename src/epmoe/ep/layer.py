"""The expert-parallel forward that replaces a packed experts module's, and the routed path.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the exchange, have their forward replaced by
:mod:`epmoe.integrations.blocks`.

Every one runs the same routed path, :func:`routed_experts` (the exchange in the middle is all-to-all-v
or the fused ops, chosen per call: :mod:`epmoe.ep.exchange`)::

    hidden_TH, top_k_index_TK, top_k_weights_TK      (from the model's own router)
      -> sort_slots            sort slots by expert, count them per expert (on the device)
      -> permute_tokens        rank-major rows
      -> _exchanged            plan_routing: exchange counts and step headers (one host read), then
                               exchange.run: to the experts' ranks, the experts' MLP, back (rank-major)
      -> unpermute_and_combine weight by the router, sum each token's K rows
    out_TH

Under ``torch.compile`` everything but ``_exchanged`` is traced; ``_exchanged`` runs eagerly behind
one graph break per layer (its all-to-all-v splits are host ints). A call with nothing to exchange
(:func:`traced_whole`: a group of one) runs its experts in place of ``_exchanged``, on counts copied
to the host inside the graph: no graph break. The grouped matmuls and the all-to-all-v are custom
ops (``epmoe::grouped_mm``, :mod:`epmoe.gmm.registry`; ``epmoe::all_to_all_v``,
:mod:`epmoe.comm.all_to_all`), opaque to the tracer.

Each forward that exchanges is the layer's next *call*; its backward starts with a step-header
exchange (where ``check_steps`` says so), before the layer's backward exchanges (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.steps import BACKWARD, FORWARD, GRAD_REDUCE, Position, StepChannel, checks_on, header_in_backward
from epmoe.ep.config import DROPPED_COUNTER, TELEMETRY_COUNTER, ExpertParallelConfig, ExpertShard
from epmoe.ep.dispatcher import SlotOrder, permute_tokens, plan_routing, sort_slots, unpermute_and_combine
from epmoe.ep.exchange import SharedMLP, choose_exchange, uses_fused
from epmoe.experts import experts_forward, runs_grouped
from epmoe.training.grads import GradSync, register_param_hooks, sync_expert_weights


@dataclass
class ExpertParallelState:
    """What epmoe keeps on the module whose forward it replaced (as ``module._epmoe``)."""

    shard: ExpertShard
    config: ExpertParallelConfig
    group: dist.ProcessGroup | None
    local_experts: nn.Module  # what runs the local experts: the packed module, or a ModuleList slice
    dispatch: str = "alltoallv"  # "alltoallv", or "fused" / "auto" where the fused ops can run these experts
    returns_router_logits: bool = False  # ModuleList blocks only: the block's own return convention
    sync: GradSync | None = None  # how the expert gradients are finished (shared by the model's experts)
    ancestors: tuple[nn.Module, ...] = ()  # the model's root down to the experts module (wrapper checks)
    sharded_names: tuple[str, ...] = ()  # packed experts: the per-expert parameters EP sliced
    channel: StepChannel | None = None  # the model's EP step channel (None on a single rank)
    layer: int = 0  # this experts module's index among the model's (step headers name it)
    calls: int = 0  # forwards that read their counts so far (step headers name them; see routed_experts)
    loads: dict[str, torch.Tensor] = field(default_factory=dict)  # counter -> (e,) int64 slots per local expert, host
    load_counters: tuple[str, ...] = (TELEMETRY_COUNTER,)  # the routed-load counters forwards add to

    def __post_init__(self):
        for counter in (*self.load_counters, DROPPED_COUNTER):
            self.add_counter(counter)

    def add_counter(self, counter: str) -> None:
        """Keep a load counter (zero), if not kept yet (epmoe.ep.load). Counters are reset in place,
        never removed: a compiled forward adds to them without recompiling."""
        self.loads.setdefault(counter, torch.zeros(self.shard.num_local_experts, dtype=torch.int64))

    def count_load(self, local_counts: list[int] | torch.Tensor, counters: tuple[str, ...] | None = None) -> None:
        """Add this forward's slots per local expert (a host list or host tensor) to ``counters``
        (default: every routed-load counter). A forward recomputed inside the backward (gradient
        checkpointing) adds nothing (a compiled one replays no Python side effect: this runs once per
        traced forward)."""
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        counts = torch.as_tensor(local_counts, dtype=torch.int64)
        for counter in counters or self.load_counters:
            self.loads[counter].add_(counts)

    def position(self, phase: int) -> Position:
        """Where this layer is for ``phase``: its latest forward call."""
        return Position(self.layer, phase, self.calls)

    def refuse_meta(self, hidden_TH: torch.Tensor) -> None:
        """Raise on hidden states on the meta device."""
        if hidden_TH.device.type == "meta":
            raise ValueError(
                f"{self.shard.module_name}: the hidden states are on the meta device: an EP model cannot run before "
                f"its weights exist (load them with epmoe.from_pretrained, or to_empty() then load a state dict)"
            )

    def backward_header(self, y_rank_major: torch.Tensor) -> torch.Tensor:
        """``y_rank_major`` (the output of the layer's last exchange), its backward checked to start
        at this layer's position, where ``config.check_steps`` asks for it."""
        if self.channel is None or not checks_on(self.config.check_steps, y_rank_major.device):
            return y_rank_major
        return header_in_backward(y_rank_major, self.channel, self.position(BACKWARD))

    def dispatch_on(self, device: torch.device) -> str:
        """``"fused"`` or ``"alltoallv"``: the exchange a call on ``device`` takes (see
        :func:`epmoe.ep.exchange.uses_fused`)."""
        return "fused" if uses_fused(self, device) else "alltoallv"

    def sharded_params(self, owner: nn.Module) -> list[nn.Parameter]:
        """The parameters that differ per EP rank (``owner``: the module this state is on): the packed
        tensors EP sliced, or every parameter of the local ``ModuleList`` experts."""
        if isinstance(self.local_experts, nn.ModuleList):
            return list(self.local_experts.parameters())
        return [getattr(owner, name) for name in self.sharded_names]

    def sync_weights(self, weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
        """The experts' weights as this forward uses them: gradients finished by :attr:`sync` (a
        :class:`~epmoe.experts.WeightsHook`)."""
        if per_parameter and self.sync is not None and self.sync.active:
            self.sync.observe(self.ancestors, weights)
            register_param_hooks(self.sync, weights, lambda: self.position(GRAD_REDUCE))
            return weights
        return sync_expert_weights(self.sync, self.ancestors, weights, self.position(GRAD_REDUCE))


def routed_experts(
    state: ExpertParallelState, hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    shared: SharedMLP | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(routed_TH, shared_TH or None)``: every token's routed experts' outputs, weighted and summed,
    and the shared expert's output where one is given (overlapped with the exchange where it can be)."""
    shard = state.shard
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_TH.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"{shard.module_name}: expected top_k_index and top_k_weights of shape (T, K) with T={hidden_TH.shape[0]}, "
            f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    state.refuse_meta(hidden_TH)
    slots = sort_slots(top_k_index, shard.num_experts)
    x_rank_major = permute_tokens(hidden_TH, slots, top_k_index.shape[1])
    if traced_whole(state, hidden_TH.device):
        counts_E = slots.tokens_per_expert.cpu()  # the one host read: a copy, which torch.compile traces
        state.count_load(counts_E)
        y_rank_major = experts_forward(state.local_experts, x_rank_major, counts_E, backend=state.config.gmm_backend)
        shared_TH = None if shared is None else shared.mlp(shared.x_TH)
    else:
        y_rank_major, shared_TH = _exchanged(state, slots, x_rank_major, shared)
    return unpermute_and_combine(y_rank_major, top_k_weights, slots, hidden_TH.dtype), shared_TH


def traced_whole(state: ExpertParallelState, device: torch.device) -> bool:
    """Whether ``torch.compile`` traces a call on ``device`` whole: one with nothing to exchange (a
    group of one, dropless, all-to-all-v, which is then none) whose experts run through grouped
    matmuls only (they take the counts as a tensor). Every other call runs its exchange in
    :func:`_exchanged`, behind one graph break."""
    return (state.channel is None and state.config.capacity_factor is None and not uses_fused(state, device)
            and runs_grouped(state.local_experts))


@torch.compiler.disable(reason="the counts exchange reads the counts to the host: one graph break per layer")
def _exchanged(state: ExpertParallelState, slots: SlotOrder, x_rank_major: torch.Tensor, shared: SharedMLP | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rank-major rows to their experts and back, with the host plan (counts exchange and step
    headers, one host read), run eagerly under ``torch.compile``."""
    state.calls += 1
    plan = plan_routing(slots, state.channel, state.position(FORWARD))
    state.count_load(plan.local_counts)
    exchange = choose_exchange(state, plan, x_rank_major.device)
    y_rank_major, shared_TH = exchange.run(x_rank_major, shared)
    return state.backward_header(y_rank_major), shared_TH


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH, _ = routed_experts(module._epmoe, hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
