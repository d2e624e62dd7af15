"""The expert-parallel forward that replaces a packed experts module's, and the routed path.

:func:`expert_parallel_forward` replaces a packed (transformers v5) experts module's forward; the
block around it (router, shared experts) runs unchanged. Blocks holding an ``nn.ModuleList`` of
experts, and blocks whose shared expert rides along the exchange, have their forward replaced by
:mod:`epmoe.integrations.blocks`.

Every one runs the same routed path, :func:`routed_experts` (the exchange in the middle is all-to-all-v
or the fused ops, chosen per call: :mod:`epmoe.ep.exchange`)::

    hidden_TH, top_k_index_TK, top_k_weights_TK      (from the model's own router)
      -> plan_routing          sort slots by expert; exchange counts and step headers (one host sync)
      -> permute_tokens        rank-major rows
      -> exchange.run          to the experts' ranks, the experts' MLP, back to the sender (rank-major)
      -> unpermute_and_combine weight by the router, sum each token's K rows
    out_TH

Each forward is the layer's next *call*; its backward starts with a step-header exchange (where
``check_steps`` says so), before the layer's backward exchanges (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.steps import BACKWARD, FORWARD, GRAD_REDUCE, Position, StepChannel, checks_on, header_in_backward
from epmoe.ep.config import TELEMETRY_COUNTER, ExpertParallelConfig, ExpertShard
from epmoe.ep.dispatcher import permute_tokens, plan_routing, unpermute_and_combine
from epmoe.ep.exchange import SharedMLP, choose_exchange, uses_fused
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
    calls: int = 0  # forwards run so far
    loads: dict[str, list[int]] = field(default_factory=dict)  # counter -> slots per local expert (epmoe.ep.load)
    load_counters: tuple[str, ...] = (TELEMETRY_COUNTER,)  # the routed-load counters forwards add to

    def count_load(self, local_counts: list[int], counters: tuple[str, ...] | None = None) -> None:
        """Add this forward's slots per local expert (from the counts exchange) to ``counters``
        (default: every routed-load counter); a forward recomputed inside the backward (gradient
        checkpointing) adds nothing."""
        if torch._C._current_graph_task_id() != -1:
            return
        for counter in counters or self.load_counters:
            total = self.loads.setdefault(counter, [0] * len(local_counts))
            for j, n in enumerate(local_counts):
                total[j] += n

    def position(self, phase: int) -> Position:
        """Where this layer is for ``phase``: its latest forward call."""
        return Position(self.layer, phase, self.calls)

    def begin_forward(self, hidden_TH: torch.Tensor) -> None:
        """Count this forward (its step headers carry the count); refuse meta tensors."""
        if hidden_TH.device.type == "meta":
            raise ValueError(
                f"{self.shard.module_name}: the hidden states are on the meta device: an EP model cannot run before "
                f"its weights exist (load them with epmoe.from_pretrained, or to_empty() then load a state dict)"
            )
        self.calls += 1

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
    state.begin_forward(hidden_TH)
    plan = plan_routing(top_k_index, shard.num_experts, state.channel, state.position(FORWARD))
    state.count_load(plan.local_counts)
    exchange = choose_exchange(state, plan, hidden_TH.device)
    x_rank_major = permute_tokens(hidden_TH, plan, top_k_index.shape[1])
    y_rank_major, shared_TH = exchange.run(x_rank_major, shared)
    y_rank_major = state.backward_header(y_rank_major)
    return unpermute_and_combine(y_rank_major, top_k_weights, plan, hidden_TH.dtype), shared_TH


def expert_parallel_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for a packed experts module's ``forward(hidden [T,H], top_k_index [T,K], top_k_weights [T,K])``."""
    shape = hidden_states.shape
    out_TH, _ = routed_experts(module._epmoe, hidden_states.reshape(-1, shape[-1]), top_k_index, top_k_weights)
    return out_TH.view(shape)
