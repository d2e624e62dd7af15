"""One model's expert parallelism: :class:`EPModel`.

:func:`epmoe.apply_expert_parallel` (and :func:`epmoe.from_pretrained`) makes one ``EPModel`` per
model, shared by the per-layer records of its experts modules (:mod:`epmoe.ep.state`)::

    EPModel                              the model's
      root                               the module EP was applied to
      paths                              per experts module, in order: the modules from the root down to it
      config                             ExpertParallelConfig
      group, channel                     the EP process group and its step channel (None on one rank)
      dp_channel                         the "dp" replicas' step channel (None without an EP x DP mesh)
      links                              LinkCosts: a byte's price on each link (with replicas; epmoe.ep.links)
      policy                             ExpertGradPolicy: sum / mean, the "dp" reduction (epmoe.ep.grads)
      guard                              StepGuard: a clip epmoe did not do, drifted replicas (epmoe.ep.guard)
    ExpertParallelState (one per layer)  shard, compute, transport, load counters -> its EPModel

What runs the model is looked at in a forward pre-hook of the root (with experts sharded only): an
active ``DistributedDataParallel`` (which must not reduce expert parameters), ``fully_shard`` on a
module of a path (FSDP2), a DeepSpeed engine's hooks; a steady forward looks again only where what
the look reads changed (DDP active, the classes or forward pre-hooks of the modules on the paths). A
wrapper seen makes the policy's ``expert_grad="auto"`` mean ``"mean"`` (sticky, logged once). Each
layer then hands the weights it is about to use to :meth:`EPModel.use_weights`, which refuses leaves
such a wrapper manages (ZeRO's partitions, FSDP2's shards), marks them as the model's expert
parameters (checked again only where the parameters, their marks, the look or the reducer changed)
and wraps them so the policy finishes their gradients.

An expert parameter carries its ``EPModel`` (:func:`expert_owner`); the ``EPModel`` keeps its
expert parameters too, weakly, so that a copy of the model (``copy.deepcopy``,
``torch.optim.swa_utils.AveragedModel``, TRL's ``create_reference_model``) gets its own ``EPModel``
(the same groups and step channels; its own policy state, guard and counters; its root the copy)
whose expert parameters are the copies of the original's: ``nn.Parameter`` copies drop attributes.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without FSDP2: no such wrapper to look for
    FSDPModule = ()

from epmoe.comm.steps import Position, StepChannel, StepChecks
from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.grads import ExpertGradPolicy, finish_weights, register_param_hooks
from epmoe.ep.guard import StepGuard
from epmoe.ep.links import LinkCosts

_MARK = "_epmoe_expert"  # on an expert parameter: the EPModel whose expert it is (read it through expert_owner)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every EPModel alive (EPModel.holding)
DEEPSPEED_EXPERT_FAMILY = "autoep_expert"  # DeepSpeed's ZeRO-3 placement of expert parameters (epmoe.prepare_deepspeed)


class EPModel:
    """The expert parallelism of one model (see the module docstring).

    ``root``: the module EP was applied to; ``config``: its :class:`ExpertParallelConfig`; ``group``
    / ``ep_size``: the EP process group (``None``: the default group) and its size; ``channel``: its
    step channel (``None`` on a single rank); ``dp_channel`` / ``dp_size``: those of the ``"dp"``
    replicas of this rank's experts (``None`` / 1 without an EP x DP mesh); ``paths``: per experts
    module, in ``named_modules()`` order, the modules from ``root`` down to it; ``links``: the EP
    group's :class:`~epmoe.ep.links.LinkCosts` (with expert replicas over more than one rank).
    """

    def __init__(
        self,
        root: nn.Module,
        config: ExpertParallelConfig,
        group: dist.ProcessGroup | None,
        ep_size: int,
        channel: StepChannel | None,
        dp_channel: StepChannel | None,
        dp_size: int,
        paths: Sequence[tuple[nn.Module, ...]],
        links: LinkCosts | None = None,
    ):
        self.root, self.config, self.group = root, config, group
        self.links = links  # what expert replicas' plan pays per byte on each link (None: no replicas)
        self.channel, self.dp_channel = channel, dp_channel
        self.paths = list(paths)
        self.policy = ExpertGradPolicy(config.expert_grad, ep_size, dp_channel, dp_size, config.check_steps)
        self.sharded = ep_size > 1  # whether the experts are sharded over more than one rank
        self.checks = StepChecks(config.check_steps)  # device type -> whether the optional step headers run
        self._fresh()
        if self.sharded:
            root.register_forward_pre_hook(self._before_forward)

    def _fresh(self) -> None:
        """What a model starts with and a copy does not share: the guard, the marks, what ran it."""
        self.guard = StepGuard(is_marked)
        self.started = False  # a forward with gradients used the experts (the guard checks from then on)
        self._experts = WeakIdKeyDictionary()  # the parameters marked as this model's experts
        self._checked_ddp: weakref.WeakSet = weakref.WeakSet()  # DDP modules seen to leave the experts alone
        self._fsdp = tuple(False for _ in self.paths)  # per experts module: fully_shard on its path (last forward)
        self._deepspeed = False  # a DeepSpeed engine hooks a module of a path (last forward)
        self._seen: tuple | None = None  # what the last look at the wrappers read (see _before_forward)
        self._checked: dict[int, tuple] = {}  # layer -> (look, reducer, *its parameters) last checked
        _LIVE.add(self)

    def __deepcopy__(self, memo: dict) -> EPModel:
        """The ``EPModel`` of a deep copy of the model (``memo`` holds the copy of :attr:`root`): the same
        groups and step channels, a copy of the policy's decisions, its own guard and marks (on the
        copies of this model's expert parameters). A part of the model copied without its root (one
        experts module) stays with this model."""
        root = memo.get(id(self.root))
        if root is None:
            return self
        copied = copy.copy(self)
        memo[id(self)] = copied
        copied.root = root
        copied.config = copy.deepcopy(self.config, memo)
        copied.checks = StepChecks(copied.config.check_steps)
        copied.paths = copy.deepcopy(self.paths, memo)
        copied.policy = copy.deepcopy(self.policy, memo)
        copied._fresh()
        copied.mark([copy.deepcopy(p, memo) for p in list(self._experts.keys())])
        return copied  # the root's copied pre-hook is bound to the copy

    @property
    def ep_size(self) -> int:
        return self.policy.ep_size

    @property
    def experts_modules(self) -> list[nn.Module]:
        """The experts modules, in order (what EP sharded: packed modules, ``ModuleList`` experts)."""
        return [path[-1] for path in self.paths]

    @property
    def guarded(self) -> bool:
        """Whether :attr:`guard` checks: sharded experts, used by a forward with gradients, under a
        data-parallel wrapper whose expert gradients epmoe finishes (DeepSpeed clips them itself:
        the policy's ``guards``)."""
        return self.started and self.policy.guards

    # ---- expert parameters

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Mark ``params`` as this model's expert parameters."""
        for p in params:
            setattr(p, _MARK, self)
            self._experts[p] = None

    def holding(self, obj: nn.Module | torch.Tensor) -> bool:
        """Whether ``obj`` is a module or parameter of :attr:`root` (a walk of the model)."""
        found = self.root.modules() if isinstance(obj, nn.Module) else self.root.parameters()
        return any(obj is x for x in found)

    # ---- the forward

    def wrapped_now(self) -> bool:
        """Whether a data-parallel wrapper may run this forward: a ``DistributedDataParallel`` forward
        is active, or ``fully_shard`` sits on a path to the experts. Attribute reads and ``isinstance``
        only (nothing the look itself changes), so ``torch.compile`` traces it without a break or a
        recompile."""
        return DistributedDataParallel._get_active_ddp_module() is not None or any(
            isinstance(m, FSDPModule) for path in self.paths for m in path
        )

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        """The root's forward pre-hook: see which data-parallel wrapper runs this forward. While
        ``torch.compile`` traces a model no wrapper can be running (:meth:`wrapped_now`), there is
        nothing to see, and nothing breaks the graph (``fullgraph=True``). Run eagerly, it looks again
        only where what the look reads may have changed since the last one: an active DDP forward, the
        classes of the modules on the paths (``fully_shard`` changes them) or their forward pre-hooks
        (a DeepSpeed engine's), or no forward with gradients yet."""
        if not torch.is_grad_enabled():
            return
        if torch.compiler.is_compiling():
            if self.wrapped_now():
                self._look_at_wrappers()
            return
        seen = tuple((type(m), *m._forward_pre_hooks) for path in self.paths for m in path)
        if seen != self._seen or not self.started or DistributedDataParallel._get_active_ddp_module() is not None:
            self._seen = seen
            self._look_at_wrappers()

    @torch.compiler.disable(reason="looks at what runs the model (DDP, FSDP2, DeepSpeed) once per forward")
    def _look_at_wrappers(self) -> None:
        """Which data-parallel wrapper runs this forward (see the module docstring)."""
        policy = self.policy
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None:
            if ddp not in self._checked_ddp:
                reduced = {id(p) for p in getattr(ddp, "_module_parameters", ())}
                if any(id(p) in reduced for p in self._experts.keys()):
                    raise ValueError(
                        "epmoe: DistributedDataParallel broadcasts and all-reduces expert parameters, which differ "
                        "on every EP rank: call apply_expert_parallel on the module you wrap with DDP (or on the "
                        "model inside the PeftModel you wrap), before wrapping it"
                    )
                self._checked_ddp.add(ddp)
            policy.set_wrapper("DistributedDataParallel")
        self._fsdp = tuple(any(isinstance(m, FSDPModule) for m in path) for path in self.paths)
        if any(self._fsdp):
            policy.set_wrapper("FSDP2 fully_shard")
        self._deepspeed = any(
            getattr(hook, "__qualname__", "").startswith("DeepSpeedEngine.")
            for path in self.paths
            for m in path
            for hook in m._forward_pre_hooks.values()
        )
        if not self.started:  # the first forward with gradients states the policy (set_wrapper states changes)
            policy.log()

    def use_weights(
        self,
        layer: int,
        weights: Sequence[torch.Tensor],
        position: Callable[[], Position],
        *,
        per_parameter: bool = False,
    ) -> list[torch.Tensor]:
        """The weights of experts module ``layer`` as its forward should use them: their leaves checked
        and marked, their gradients finished by :attr:`policy` (``weights`` wrapped, or with
        ``per_parameter`` a gradient hook on each, for experts run by their own forward).
        ``position()``: the layer's position, for the step header of a ``"dp"`` reduction."""
        weights = list(weights)
        if not self.sharded:
            return weights
        policy = self.policy
        if torch.is_grad_enabled():
            # eagerly, the same parameters as the last forward's, still marked as this model's, and nothing
            # the look at the wrappers reads changed since they were checked: nothing to check or mark again
            checked = () if torch.compiler.is_compiling() else self._checked.get(layer, ())
            if not (
                len(checked) == len(weights) + 2
                and checked[0] == self._seen
                and checked[1] == policy.reducer
                and all(w is c and getattr(w, _MARK, None) is self for w, c in zip(weights, checked[2:]))
            ):
                self._check_leaves(layer, weights)
        if per_parameter:
            register_param_hooks(policy, weights, position, self.arm_guard)
            return weights
        if not any(w.requires_grad for w in weights) or not (policy.finishes or (self.started and policy.guards)):
            return weights
        return finish_weights(policy, weights, position(), self.arm_guard)

    def _check_leaves(self, layer: int, weights: list[torch.Tensor]) -> None:
        """Refuse expert leaves that a wrapper seen by :meth:`_before_forward` manages; mark them (run
        by :meth:`use_weights` in a forward with gradients); parameters are remembered as checked."""
        leaves = [leaf for w in weights for leaf in _leaves(w)]
        self.started = True
        if any(
            hasattr(p, "ds_id") and getattr(p, "ds_zero_placement_family", None) != DEEPSPEED_EXPERT_FAMILY
            for p in leaves
        ):
            raise ValueError(
                "epmoe: DeepSpeed ZeRO stage 3 partitions the expert parameters, which differ on every EP rank, "
                "over all ranks: call epmoe.prepare_deepspeed(model) after apply_expert_parallel and before "
                "deepspeed.initialize (a Trainer: epmoe.prepare_trainer(trainer)), which puts them on DeepSpeed's "
                "expert placement, or use FSDP2 with "
                "fully_shard(..., ignored_params=set(epmoe.expert_parameters(model)))"
            )
        if self.policy.reducer is None and (self._deepspeed or any(hasattr(p, "_hp_mapping") for p in leaves)):
            raise ValueError(
                "epmoe: DeepSpeed manages the expert parameters, which differ on every EP rank, as replicated "
                "ones: its start-up broadcast has overwritten this rank's experts with rank 0's and its reduction "
                "would mix different experts' gradients. Call epmoe.prepare_deepspeed(model) after "
                "apply_expert_parallel and before deepspeed.initialize (a Trainer: epmoe.prepare_trainer(trainer) "
                "before train()); ZeRO stages 1, 2 and 3 are supported"
            )
        if layer < len(self._fsdp) and self._fsdp[layer] and not all(is_marked(p) for p in leaves):
            raise ValueError(
                "epmoe: fully_shard is sharding expert parameters, which differ on every EP rank: pass "
                "ignored_params=set(epmoe.expert_parameters(model)) to every fully_shard call"
            )
        unmarked = [p for p in leaves if getattr(p, _MARK, None) is not self]
        if unmarked:  # the first forward's leaves (or new ones: a PEFT wrapper, a substitute)
            self.mark(unmarked)
        if not torch.compiler.is_compiling() and all(isinstance(w, nn.Parameter) for w in weights):  # no graph kept
            self._checked[layer] = (self._seen, self.policy.reducer, *weights)

    # ---- the step guard

    def arm_guard(self) -> None:
        """Called while a backward finishes expert gradients: the guard records them once it ends
        (``check_steps=False``: nothing recorded, the guard's gradient check off)."""
        if self.guarded and self.config.check_steps is not False:
            self.guard.arm(self.root)

    def guard_payload(self, device: torch.device) -> torch.Tensor:
        """The guard's ``(VALUES,)`` values for the counts exchange of the first experts module's forward."""
        return self.guard.payload(self.root, device)


def expert_owner(param: torch.Tensor) -> EPModel | None:
    """The :class:`EPModel` whose expert parameter ``param`` is marked to be, or ``None``."""
    return getattr(param, _MARK, None)


def is_marked(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert parameter of some model (any EP size)."""
    return expert_owner(param) is not None


def live_models() -> list[EPModel]:
    """Every :class:`EPModel` alive, in no particular order."""
    return list(_LIVE)


def _leaves(tensor: torch.Tensor) -> list[nn.Parameter]:
    """The parameters ``tensor`` is (or is computed from), by a walk of its autograd graph."""
    if isinstance(tensor, nn.Parameter):
        return [tensor]
    found, seen, stack = [], set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, nn.Parameter):
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
