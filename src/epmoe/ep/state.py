"""What epmoe keeps on a model it made expert-parallel, and the queries over it.

:func:`epmoe.apply_expert_parallel` makes one :class:`~epmoe.ep.model.EPModel` for the model (its
groups and step channels, the gradient policy, the step guard, the root and its experts modules in
order: :mod:`epmoe.ep.model`) and attaches to each module whose forward it replaced (a packed
experts module, or the block around ``nn.ModuleList`` experts) one :class:`ExpertParallelState`,
the slim record of that layer::

    ExpertParallelState   shard        which experts this rank holds (ExpertShard)
                          experts      the local experts and how they compute (LocalExperts; their
                                       weights and layout: .weights, ExpertWeights)
                          transport    how its tokens travel (epmoe.ep.dispatch)
                          loads        its routed-load counters (epmoe.ep.counters)
                          steps        its index among the model's experts modules, its forwards so far
                                       (epmoe.ep.position)
                          model        -> the EPModel (config, group, channel, policy, guard, root)

Every other part of epmoe reads them through this module, never through the attribute::

    ep_model(module_or_parameter)  the EPModel of a model (or of a copy of one), or None
    state_of(module)               the module's record, or None
    ep_states(model)               (name, module, record) of every experts module, any EP size
    sharded_experts(model)         the same, only where the experts are sharded over more than one rank
    sharded_parameters(model)      every parameter that differs per EP rank (PEFT factors not included)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.steps import GRAD_REDUCE, StepChannel
from epmoe.ep.config import ExpertShard
from epmoe.ep.counters import LoadCounters
from epmoe.ep.experts import LocalExperts
from epmoe.ep.model import EPModel, expert_owner, live_models
from epmoe.ep.position import LayerPosition

_ATTRIBUTE = "_epmoe"  # where a module keeps its record: read it through state_of


@dataclass
class ExpertParallelState:
    """One experts module's record: what it holds, how it runs, where it is in the step; the rest is
    its model's (:attr:`model`). ``copy.deepcopy`` of the model copies it with the model's
    :class:`~epmoe.ep.model.EPModel` (its own counters and position, the copy's ``EPModel``)."""

    shard: ExpertShard
    model: EPModel  # the model's expert parallelism (shared by the model's experts modules)
    experts: LocalExperts  # the local experts and how they compute (decided when EP was applied)
    transport: Any = None  # the layer's Dispatcher (epmoe.ep.dispatch): how its tokens move, built when EP was applied
    returns_router_logits: bool = False  # ModuleList blocks only: the block's own return convention
    sharded_names: tuple[str, ...] = ()  # packed experts: the per-expert parameters EP sliced
    # of those, the ones whose unsharded tensor has rows no expert reads (zero-computation experts'): how many
    unread_rows: dict[str, int] = field(default_factory=dict)
    steps: LayerPosition = field(default_factory=LayerPosition)  # its index among the model's, its calls so far
    loads: LoadCounters = field(init=False)  # its routed-load counters

    def __post_init__(self):
        self.loads = LoadCounters(self.shard.num_local_experts)

    @property
    def layer(self) -> int:
        """This experts module's index among the model's (step headers name it)."""
        return self.steps.layer

    @property
    def channel(self) -> StepChannel | None:
        """The model's EP step channel (``None``: a group of one); with :attr:`loads` and :attr:`device`,
        this record is a :class:`~epmoe.ep.counters.CountedLayer`."""
        return self.model.channel

    @property
    def device(self) -> torch.device:
        """Where the local experts, and the EP group's exchanges of this layer, are."""
        return next(self.local_experts.parameters()).device

    @property
    def local_experts(self) -> nn.Module:
        """The module that holds the local experts: the packed module, or the local ``ModuleList`` slice."""
        return self.experts.module

    def sharded_params(self, owner: nn.Module) -> list[nn.Parameter]:
        """The parameters that differ per EP rank (``owner``: the module this state is on): the packed
        tensors EP sliced, or the local ``ModuleList`` experts' parameters (not those the experts
        share: :attr:`~epmoe.ep.expert_weights.ExpertWeights.shared_names`)."""
        if isinstance(self.local_experts, nn.ModuleList):
            return self.experts.weights.expert_parameters()
        return [owner.get_parameter(name) for name in self.sharded_names]

    def sync_weights(self, weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
        """The experts' weights as this forward uses them, gradients finished by the model's policy
        (:meth:`~epmoe.ep.model.EPModel.use_weights`; this method is the
        :class:`~epmoe.ep.expert_weights.WeightsHook` the experts' compute takes)."""
        return self.model.use_weights(
            self.steps.layer, weights, lambda: self.steps.at(GRAD_REDUCE), per_parameter=per_parameter
        )


def attach_state(module: nn.Module, state: ExpertParallelState) -> None:
    """Keep ``state`` on ``module`` (the module whose forward epmoe replaced)."""
    setattr(module, _ATTRIBUTE, state)


def state_of(module: nn.Module | None) -> ExpertParallelState | None:
    """The EP record kept on ``module``, or ``None``."""
    return getattr(module, _ATTRIBUTE, None) if module is not None else None


def ep_model(obj: nn.Module | torch.Tensor) -> EPModel | None:
    """The :class:`~epmoe.ep.model.EPModel` that :func:`epmoe.apply_expert_parallel` (or
    :func:`epmoe.from_pretrained`) made for the model ``obj`` belongs to, or ``None``.

    ``obj``: any module of the model, a module holding it (a wrapper: DDP, a PeftModel, an
    ``AveragedModel``...), or any of its parameters. A copy of the model (``copy.deepcopy``,
    ``AveragedModel``, TRL's ``create_reference_model``) has its own. An expert parameter or a module
    holding experts answers at once; any other is looked for in every EP model alive (a walk).
    """
    if isinstance(obj, torch.Tensor):
        owner = expert_owner(obj)
    elif isinstance(obj, nn.Module):
        owner = next((state.model for _, _, state in ep_states(obj)), None)
    else:
        raise TypeError(f"ep_model(obj): expected an nn.Module or a parameter, got {type(obj).__name__}")
    return owner if owner is not None else next((m for m in live_models() if m.holding(obj)), None)


def ep_states(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertParallelState]]:
    """``(name, module, record)`` of every module of ``model`` holding an EP record, in ``named_modules()``
    order (any EP size)."""
    for name, module in model.named_modules():
        state = state_of(module)
        if state is not None:
            yield name, module, state


def sharded_experts(
    model: nn.Module, *, packed_only: bool = False
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
    found = ep_model(model)
    return found.group if found is not None else None
