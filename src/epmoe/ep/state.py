"""What epmoe keeps on a model it made expert-parallel, and the queries over it.

:func:`epmoe.apply_expert_parallel` attaches one :class:`ExpertParallelState` to each module whose
forward it replaced (a packed experts module, or the block around ``nn.ModuleList`` experts). Every
other part of epmoe reads it through this module, never through the attribute::

    state_of(module)          the module's state, or None
    ep_states(model)          (name, module, state) of every experts module, any EP size
    sharded_experts(model)    the same, only where the experts are sharded over more than one rank
    sharded_parameters(model) every parameter that differs per EP rank (PEFT factors not included)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.steps import BACKWARD, GRAD_REDUCE, Position, StepChannel, checks_on, header_in_backward
from epmoe.ep.config import DROPPED_COUNTER, TELEMETRY_COUNTER, ExpertParallelConfig, ExpertShard
from epmoe.ep.experts import LocalExperts
from epmoe.ep.grads import GradSync, register_param_hooks, sync_expert_weights

_ATTRIBUTE = "_epmoe"  # where a module keeps its state: read it through state_of


@dataclass
class ExpertParallelState:
    """One experts module's EP state: what it holds, how it runs, where it is in the step."""

    shard: ExpertShard
    config: ExpertParallelConfig
    group: dist.ProcessGroup | None
    experts: LocalExperts  # the local experts and how they compute (decided when EP was applied)
    transport: Any = None  # the layer's Dispatcher (epmoe.ep.dispatch): how its tokens move, built when EP was applied
    returns_router_logits: bool = False  # ModuleList blocks only: the block's own return convention
    sync: GradSync | None = None  # how the expert gradients are finished (shared by the model's experts)
    ancestors: tuple[nn.Module, ...] = ()  # the model's root down to the experts module (wrapper checks)
    sharded_names: tuple[str, ...] = ()  # packed experts: the per-expert parameters EP sliced
    channel: StepChannel | None = None  # the model's EP step channel (None on a single rank)
    layer: int = 0  # this experts module's index among the model's (step headers name it)
    calls: int = 0  # forwards that read their counts so far (step headers name them)
    loads: dict[str, torch.Tensor] = field(default_factory=dict)  # counter -> (e,) int64 slots per local expert, host
    load_counters: tuple[str, ...] = (TELEMETRY_COUNTER,)  # the routed-load counters forwards add to

    def __post_init__(self):
        for counter in (*self.load_counters, DROPPED_COUNTER):
            self.add_counter(counter)

    def __deepcopy__(self, memo: dict) -> ExpertParallelState:
        """The state of a deep copy of the model (``copy.deepcopy``: EMA and reference models): its
        own experts, counters and position, the same process group and step channel."""
        copied = {f.name: getattr(self, f.name) if f.name in ("group", "channel")
                  else copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(self)}
        return type(self)(**copied)

    @property
    def local_experts(self) -> nn.Module:
        """The module that holds the local experts: the packed module, or the local ``ModuleList`` slice."""
        return self.experts.module

    def add_counter(self, counter: str) -> None:
        """Keep a load counter (zero), if not kept yet (epmoe.ep.load). Counters are reset in place,
        never removed: a compiled forward adds to them without recompiling."""
        self.loads.setdefault(counter, torch.zeros(self.shard.num_local_experts, dtype=torch.int64))

    def count_load(self, local_counts: list[int] | torch.Tensor, counters: tuple[str, ...] | None = None) -> None:
        """Add this forward's slots per local expert (a host list, or a tensor on whatever device
        holds it: counts that never left the device are added there, not read) to ``counters``
        (default: every routed-load counter). A forward recomputed inside the backward (gradient
        checkpointing) adds nothing (a compiled one replays no Python side effect: this runs once per
        traced forward)."""
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        counts = torch.as_tensor(local_counts, dtype=torch.int64)
        for counter in counters or self.load_counters:
            if self.loads[counter].device != counts.device:  # counts on the device: the counter follows them
                self.loads[counter] = self.loads[counter].to(counts.device)
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
        """``y_rank_major`` (the output of the layer's combine), its backward checked to start at this
        layer's position, where ``config.check_steps`` asks for it."""
        if self.channel is None or not checks_on(self.config.check_steps, y_rank_major.device):
            return y_rank_major
        return header_in_backward(y_rank_major, self.channel, self.position(BACKWARD))

    def sharded_params(self, owner: nn.Module) -> list[nn.Parameter]:
        """The parameters that differ per EP rank (``owner``: the module this state is on): the packed
        tensors EP sliced, or every parameter of the local ``ModuleList`` experts."""
        if isinstance(self.local_experts, nn.ModuleList):
            return list(self.local_experts.parameters())
        return [getattr(owner, name) for name in self.sharded_names]

    def sync_weights(self, weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
        """The experts' weights as this forward uses them, gradients finished by :attr:`sync` (this
        method is the :class:`~epmoe.ep.experts.WeightsHook` the experts' compute takes)."""
        if per_parameter and self.sync is not None and self.sync.active:
            self.sync.observe(self.ancestors, weights)
            register_param_hooks(self.sync, weights, lambda: self.position(GRAD_REDUCE))
            return weights
        return sync_expert_weights(self.sync, self.ancestors, weights, self.position(GRAD_REDUCE))


def attach_state(module: nn.Module, state: ExpertParallelState) -> None:
    """Keep ``state`` on ``module`` (the module whose forward epmoe replaced)."""
    setattr(module, _ATTRIBUTE, state)


def state_of(module: nn.Module | None) -> ExpertParallelState | None:
    """The EP state kept on ``module``, or ``None``."""
    return getattr(module, _ATTRIBUTE, None) if module is not None else None


def ep_states(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertParallelState]]:
    """``(name, module, state)`` of every module of ``model`` holding EP state, in ``named_modules()``
    order (any EP size)."""
    for name, module in model.named_modules():
        state = state_of(module)
        if state is not None:
            yield name, module, state


def sharded_experts(model: nn.Module, *, packed_only: bool = False
                    ) -> Iterator[tuple[str, nn.Module, ExpertParallelState]]:
    """:func:`ep_states` whose experts are sharded over more than one rank: packed experts modules,
    and (unless ``packed_only``) blocks around ``nn.ModuleList`` experts."""
    for name, module, state in ep_states(model):
        if state.shard.ep_size == 1:
            continue
        if packed_only and isinstance(state.local_experts, nn.ModuleList):
            continue
        yield name, module, state


def sharded_parameters(model: nn.Module) -> Iterator[tuple[nn.Parameter, ExpertParallelState]]:
    """``(parameter, its state)`` for every parameter EP sharded (PEFT factors on them excluded)."""
    for _, module, state in sharded_experts(model):
        for param in state.sharded_params(module):
            yield param, state


def require_ep_states(model: nn.Module, caller: str) -> list[tuple[str, ExpertParallelState]]:
    """``(experts module name, state)`` of every experts module of an EP model (any EP size);
    ``TypeError`` / ``ValueError`` naming ``caller`` for anything else."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}(model): expected an nn.Module, got {type(model).__name__}")
    found = [(state.shard.module_name, state) for _, _, state in ep_states(model)]
    if not found:
        raise ValueError(f"{caller}(model): {type(model).__name__} is not expert-parallel (call apply_expert_parallel)")
    return found


def ep_group_of(model: nn.Module) -> dist.ProcessGroup | None:
    """The EP process group of ``model``'s experts (``None``: the default group, or not EP)."""
    return next((state.group for _, _, state in ep_states(model)), None)
