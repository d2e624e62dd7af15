"""``apply_expert_parallel``: find a model's experts modules, keep this rank's block, swap the forward.

Rank ``r`` of the ``W`` ranks of the EP group keeps global experts ``[r*e, (r+1)*e)``, ``e = E/W``,
of every experts module::

    E = 8, W = 2          experts 0 1 2 3 | 4 5 6 7
    rank 0 holds           0 1 2 3
    rank 1 holds                            4 5 6 7

The expert weights stay plain ``nn.Parameter``s under their own names, sliced to ``e = E/W`` experts
(an ``nn.ModuleList`` keeps its length; entries of other ranks become empty placeholders, so the
local experts keep their global index in their names). Routers, shared experts and everything else
are untouched. A packed experts module's forward becomes :func:`~epmoe.ep.layer.expert_parallel_forward`
(with zero-computation experts, :func:`~epmoe.integrations.zero_experts.zero_experts_forward`; the
module around a holder of stacked-rows experts calls the holder's);
for ``nn.ModuleList`` experts the enclosing block's forward becomes
:func:`~epmoe.integrations.blocks.expert_parallel_block_forward`. Each experts module's transport is
decided here, once (``config.dispatch``, ``"auto"`` resolved: :mod:`epmoe.ep.dispatch`), and its
dispatcher built; where it is ``"fused"`` and the block is a known shared-expert block, the block's
forward becomes :func:`~epmoe.integrations.blocks.shared_block_forward` (the shared expert rides in
the fused ops' gaps).
Experts modules it cannot run (:func:`~epmoe.ep.recognize.unsupported_experts`) are refused, on every
rank and before anything is changed, naming each experts class, its module path and why. Packed
experts that take every token (Llama4's, adopted by :mod:`epmoe.ep.recognize`) get their block's
forward replaced by :func:`~epmoe.integrations.input_weighted.input_weighted_block_forward`, after a
probe shows the block computes what that forward does.
What EP keeps is one :class:`~epmoe.ep.model.EPModel` for the model (groups, step channels,
gradient policy, step guard, the experts modules in order; ``epmoe.ep_model(model)``) and one
:class:`~epmoe.ep.state.ExpertParallelState` record per module whose forward was replaced.

With experts sharded (EP size > 1) the model also gets, as instance attributes: the names DDP must
ignore (:mod:`epmoe.ep.params`), a ``generate`` that keeps every rank stepping
(:mod:`epmoe.training.generate`), on transformers models a ``save_pretrained`` that writes every
expert (:mod:`epmoe.checkpoint.save`) and a ``num_parameters`` that counts every expert, and a
warning on a bare ``state_dict()`` of sharded experts (:mod:`epmoe.checkpoint.state_dict_warning`). Sharded
packed experts tensors carry their :class:`~epmoe.ep.shard_mark.ShardMark` (checked here, on every
rank, against the unsharded tensor's shape), the 3-D ones their whole shape as ``ds_shape`` and their
block a forward pre-hook, so that PEFT LoRA added afterwards starts from the unsharded model's factors
(:mod:`epmoe.ep.lora`). Its experts then communicate on groups created for EP with ``config.timeout``,
every collective behind a step header (:mod:`epmoe.comm.steps`).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe import platform
from epmoe.checkpoint.save import GatherExperts, SavePretrained
from epmoe.checkpoint.state_dict_warning import warn_on_bare_state_dict
from epmoe.comm.steps import (
    AGREE,
    StepChannel,
    dtype_code,
    dtype_name,
    step_group,
    step_timeout_s,
    value_code,
)
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.config import ExpertParallelConfig, ExpertShard
from epmoe.ep.contract import unfaithful_experts
from epmoe.ep.counts import CountsRow
from epmoe.ep.dispatch import NodeGroups
from epmoe.ep.expert_weights import family_compute_dtype
from epmoe.ep.experts import LocalExperts, experts_gmm_backends
from epmoe.ep.layer import expert_parallel_forward
from epmoe.ep.links import link_costs
from epmoe.ep.lora import install_settle_hook, mark_full_shapes
from epmoe.ep.model import EPModel
from epmoe.ep.params import ExpertParameterNames, NumParameters, expert_parameters, parameter_counts
from epmoe.ep.position import LayerPosition
from epmoe.ep.recognize import (
    expert_rows,
    fused_ineligible_reason,
    num_experts_of,
    per_expert_post,
    set_parameter,
    shared_parameters,
    takes_every_token,
    unsupported_experts,
    zero_experts,
)
from epmoe.ep.shard_mark import mark_of
from epmoe.ep.state import ExpertParallelState, attach_state, sharded_experts, state_of
from epmoe.ep.topology import NodeLayout, nodes_of_ranks, two_level_layout
from epmoe.ep.transports import make_dispatcher, static_ineligible_reason
from epmoe.gmm import choose_backend
from epmoe.integrations.blocks import (
    block_router,
    block_top_k,
    expert_parallel_block_forward,
    is_shared_expert_block,
    shared_block_forward,
)
from epmoe.integrations.input_weighted import input_weighted_block_forward, input_weighted_block_reason
from epmoe.integrations.releases import is_transformers_model, served_from, untested_release
from epmoe.integrations.zero_experts import zero_experts_forward
from epmoe.training.generate import SyncedGenerate

logger = logging.getLogger(__name__)


def resolve_groups(ep_group: Any) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(ep group, dp group or None)`` from a ProcessGroup, a DeviceMesh or ``None``.

    A 1-D mesh is the EP group; a 2-D mesh needs dims named ``"ep"`` and ``"dp"``: experts sharded over
    ``"ep"``, replicated over ``"dp"`` (their gradients reduced over it, see :mod:`epmoe.ep.grads`).
    """
    if ep_group is None or isinstance(ep_group, dist.ProcessGroup):
        return ep_group, None
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(ep_group, mesh_type):
        if ep_group.ndim == 1:
            return ep_group.get_group(), None
        names = ep_group.mesh_dim_names or ()
        if "ep" not in names:
            raise ValueError(f"ep_group: a {ep_group.ndim}-D DeviceMesh needs a dim named 'ep', has {names}")
        if ep_group.ndim != 2 or "dp" not in names:
            raise ValueError(
                f"ep_group: a {ep_group.ndim}-D DeviceMesh must have exactly the dims ('dp', 'ep'), has {names}: "
                f"experts are replicated over every other dim, and only 'dp' replicas get their gradients reduced"
            )
        return ep_group.get_group("ep"), ep_group.get_group("dp")
    raise TypeError(f"ep_group: expected a ProcessGroup, DeviceMesh or None, got {type(ep_group).__name__}")


class NonLocalExpert(nn.Module):
    """Placeholder, in a sharded ``nn.ModuleList``, for an expert another rank holds."""

    def __init__(self, ep_rank: int):
        super().__init__()
        self.ep_rank = ep_rank

    def extra_repr(self) -> str:
        return f"held by EP rank {self.ep_rank}"


def apply_expert_parallel(
    model: nn.Module, ep_group: Any = None, *, config: ExpertParallelConfig | dict | None = None
) -> list[ExpertShard]:
    """Turn ``model`` into an expert-parallel model, in place (see the module docstring).

    ``ep_group``: a ProcessGroup, a 1-D DeviceMesh, a ``("dp", "ep")`` DeviceMesh or ``None`` (the
    default group); ``config``: an :class:`ExpertParallelConfig`, a dict of its fields or ``None``.
    Each rank then runs the model on its own batch and gets the unsharded model's outputs, losses
    and gradients on that batch (expert gradients summed over every rank's tokens, or averaged, see
    ``ExpertParallelConfig.expert_grad``). Returns one :class:`ExpertShard` per experts module, in
    ``model.named_modules()`` order. A second call on the same model returns the same shards (with
    the same group size) and changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_expert_parallel(model): expected an nn.Module, got {type(model).__name__}")
    config = ExpertParallelConfig.from_any(config)
    group, dp_group, ep_rank, ep_size, dp_size = _groups_and_ranks(ep_group)
    found = find_experts_modules(model)
    if not found:
        raise ValueError(
            _refusal(model, found) or f"apply_expert_parallel(model): no experts module found in {type(model).__name__}"
        )
    applied = _shards_applied_before(found, ep_size)
    if applied is not None:
        return applied

    # Validate everything before changing anything (no half-sharded model after an error), then let
    # the EP ranks compare notes, so that an error or a mismatch raises on every rank instead of
    # leaving the others waiting in a later collective.
    try:
        checked, error = _validate(model, found, config, ep_rank, ep_size), None
    except (ValueError, TypeError) as exc:
        checked, error = None, exc
    _check_ranks_agree(group, ep_size, config, found, error)
    nodes_by_rank = _nodes_by_rank(group, ep_size, config)
    checked.nodes = _two_level(group, ep_rank, nodes_by_rank, config, checked, found) if nodes_by_rank else None

    modules = dict(model.named_modules())
    ep_channel, dp_channel = _step_channels(group, ep_size, dp_group, dp_size, config, checked)
    links = _links(config, ep_channel, nodes_by_rank, found)
    ep_model = EPModel(
        model,
        config,
        group,
        ep_size,
        ep_channel,
        dp_channel,
        dp_size,
        [_ancestors(modules, name) for name, _, _ in found],
        links,
    )
    unsharded = _unsharded_shapes(found)  # before sharding: what each ShardMark must say
    _swap_forwards(modules, found, checked, ep_model, config)
    if ep_model.sharded:
        _attach_to_model(model, unsharded)
    _log_applied(model, checked, len(found), ep_size, config)
    return checked.shards


def _nodes_by_rank(group, ep_size: int, config: ExpertParallelConfig) -> list[int] | None:
    """Each EP rank's node, where the two-level exchange or the replicas' link costs read it
    (:func:`~epmoe.ep.topology.nodes_of_ranks`), else ``None``."""
    if ep_size > 1 and (config.dispatch in ("auto", "nodes") or config.replicas):
        return nodes_of_ranks(config, group, ep_size, step_timeout_s(config.timeout, group))
    return None


def _links(config: ExpertParallelConfig, channel, nodes_by_rank, found: list):
    """What the replica plans pay per byte on each link (:func:`~epmoe.ep.links.link_costs`), with
    replicas over more than one rank; else ``None``."""
    if not config.replicas or channel is None:
        return None
    return link_costs(config, channel, nodes_by_rank, _probe_weight(found[0][1]))


def _groups_and_ranks(ep_group: Any) -> tuple[Any, Any, int, int, int]:
    """``(group, dp_group, ep_rank, ep_size, dp_size)`` of what ``apply_expert_parallel`` was given
    (a group of one where torch.distributed is not initialized and no group was)."""
    group, dp_group = resolve_groups(ep_group)
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("apply_expert_parallel(ep_group): torch.distributed is not initialized")
        return group, dp_group, 0, 1, 1
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    return group, dp_group, dist.get_rank(group), dist.get_world_size(group), dp_size


def _log_applied(
    model: nn.Module, checked: _Checked, num_modules: int, ep_size: int, config: ExpertParallelConfig
) -> None:
    """What was applied, in the log: the transport each module fell back to, the grouped-matmul
    backend, the model's parameters (every expert once: a framework's count shows this rank's)."""
    if checked.declined_fused:
        name, reason = next(iter(checked.declined_fused.items()))
        logger.warning(
            "epmoe: %d experts modules (first: %s) run dispatch='alltoallv', not 'fused': %s",
            len(checked.declined_fused),
            name,
            reason,
        )
    declined = checked.declined_backends
    logger.info(
        "epmoe: %d experts modules expert-parallel over %d ranks; grouped matmul backend %r (requested %r%s)",
        num_modules,
        ep_size,
        checked.backend.name if checked.backend else "chosen at the first forward (meta weights)",
        config.gmm_backend,
        "; declined: " + "; ".join(declined) if declined else "",
    )
    (_, whole), local = parameter_counts(model), sum(p.numel() for p in model.parameters())
    logger.info(
        "epmoe: the model holds %s parameters, every expert once (this rank holds %s)", f"{whole:,}", f"{local:,}"
    )


def _shards_applied_before(found: list, ep_size: int) -> list[ExpertShard] | None:
    """The shards of an earlier ``apply_expert_parallel`` over ``ep_size`` ranks on these experts
    modules, or ``None`` where none was applied; ``ValueError`` for another size or a partial one."""
    done = [state_of(owner) for _, _, owner in found]
    if all(state is not None for state in done):
        sizes = {state.shard.ep_size for state in done}
        if sizes != {ep_size}:
            raise ValueError(
                f"apply_expert_parallel(model): already expert-parallel over {sizes.pop()} ranks, not {ep_size}"
            )
        return [state.shard for state in done]
    if any(state is not None for state in done):
        raise ValueError("apply_expert_parallel(model): the model is partly expert-parallel already")
    return None


def _swap_forwards(
    modules: dict[str, nn.Module], found: list, checked: _Checked, ep_model: EPModel, config: ExpertParallelConfig
) -> None:
    """Shard each experts module, keep its record (its dispatcher built here, once) and swap the
    forwards that run it: the packed module's, a ``ModuleList``'s block's, a fused shared-expert block's.
    Expert weights tied across modules (one parameter in two experts modules) stay tied."""
    tied: dict[int, nn.Parameter] = {}
    for layer, ((name, module, owner), shard, transport, returns_logits) in enumerate(
        zip(found, checked.shards, checked.transport, checked.returns_logits)
    ):
        shared = [p for _, p in shared_parameters(module)]  # found on all E experts, before sharding
        if isinstance(module, nn.ModuleList):
            local = LocalExperts(_shard_module_list(module, shard), config.gmm_backend, shared)
            dispatcher = make_dispatcher(transport, shard, local, config, checked.nodes)
            attach_state(
                owner,
                ExpertParallelState(
                    shard,
                    ep_model,
                    local,
                    transport=dispatcher,
                    returns_router_logits=returns_logits,
                    steps=LayerPosition(layer),
                ),
            )
            owner.forward = types.MethodType(expert_parallel_block_forward, owner)
        else:
            sharded, unread = _shard_parameters(module, shard, tied)
            local = LocalExperts(module, config.gmm_backend, shared, post=per_expert_post(module))
            dispatcher = make_dispatcher(transport, shard, local, config, checked.nodes)
            attach_state(
                module,
                ExpertParallelState(
                    shard,
                    ep_model,
                    local,
                    transport=dispatcher,
                    sharded_names=sharded,
                    unread_rows=unread,
                    steps=LayerPosition(layer),
                ),
            )
            forward = zero_experts_forward if zero_experts(module) else expert_parallel_forward
            module.forward = types.MethodType(forward, module)
            if owner is not module:  # stacked-rows experts: the module around their holder calls it
                owner.forward = module.forward
            block = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
            if sharded:
                warn_on_bare_state_dict(module)
            if block is not None and (sharded or owner is not module):
                # LoRA factors peft makes for all E experts: narrowed before use (on stacked rows: refused)
                install_settle_hook(block, name.rsplit(".", 1)[1])
            if takes_every_token(module):  # the block calls them with every token: it gets epmoe's forward
                block.forward = types.MethodType(input_weighted_block_forward, block)
            elif transport == "fused" and block is not None and is_shared_expert_block(block, module):
                block.forward = types.MethodType(shared_block_forward, block)


def _attach_to_model(model: nn.Module, unsharded: dict[tuple[str, str], tuple[int, ...]]) -> None:
    """What a model with sharded experts gets as instance attributes (see the module docstring);
    ``unsharded``: :func:`_unsharded_shapes`, which every sharded parameter's mark is checked against."""
    expert_parameters(model)  # marks them
    mark_full_shapes(model)  # peft's LoRA factors start as the unsharded model's (epmoe.ep.lora)
    _check_shard_marks(model, unsharded)
    # what DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets, named when DDP reads it
    model._ddp_params_and_buffers_to_ignore = ExpertParameterNames(model)
    if SyncedGenerate.applies_to(model):
        model.generate = SyncedGenerate(model)
    if is_transformers_model(model):
        if callable(getattr(type(model), "gather_sharded_state_dict_for_save", None)):  # 5.6 has no such hook
            model.gather_sharded_state_dict_for_save = GatherExperts(model)
        model.save_pretrained = SavePretrained(model)
        model.num_parameters = NumParameters(model)


def _step_channels(
    group, ep_size: int, dp_group, dp_size: int, config: ExpertParallelConfig, checked: _Checked
) -> tuple[StepChannel | None, StepChannel | None]:
    """The model's EP and ``"dp"`` step channels, each on a group created for it with
    ``config.timeout`` (see :mod:`epmoe.comm.steps`); ``None`` for a group of one."""
    shards, nodes = checked.shards, checked.nodes
    names = tuple(shard.module_name for shard in shards)
    width = CountsRow.widest(shards, bool(config.replicas), nodes[0].ranks_per_node if nodes is not None else None)
    timeout = step_timeout_s(config.timeout, group)
    ep = StepChannel(step_group(group, timeout), width, names, timeout) if ep_size > 1 else None
    dp = StepChannel(step_group(dp_group, timeout), 1, names, timeout, what="dp") if dp_size > 1 else None
    return ep, dp


@dataclasses.dataclass
class _Checked:
    """What :func:`_validate` decided, per experts module where a list."""

    shards: list[ExpertShard]
    transport: list[str]  # the transport per module (epmoe.ep.transports.TRANSPORTS)
    returns_logits: list[bool]  # ModuleList blocks: whether the block's own forward returns router logits
    backend: Any  # the grouped-matmul backend the experts run (None for meta weights: chosen per forward)
    declined_backends: list[str]
    declined_fused: dict[str, str]  # module name -> why a requested fused path is declined
    nodes: tuple[NodeLayout, NodeGroups] | None = None  # the two-level exchange's layout and groups, where run


def _validate(
    model: nn.Module,
    found: list[tuple[str, nn.Module, nn.Module]],
    config: ExpertParallelConfig,
    ep_rank: int,
    ep_size: int,
) -> _Checked:
    """Every check and probe, nothing changed; ValueError / TypeError naming the module on failure."""
    refused = _unservable(model)
    if refused is not None:
        raise ValueError(refused)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        wrapper = _data_parallel_wrapper(module)
        if wrapper is not None:
            where = f"the model is wrapped by {wrapper}" if not name else f"{name} is wrapped by {wrapper}"
            raise ValueError(
                f"apply_expert_parallel: {where}; apply expert parallelism first, then wrap the model "
                f"(the wrapper would otherwise broadcast and average expert shards that differ per rank)"
            )
    refusal = _refusal(model, found)
    if refusal is not None:
        raise ValueError(refusal)
    checked = _Checked([], [], [], None, [], {})
    for name, module, owner in found:
        wrapper = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        if wrapper is not None and getattr(wrapper, "base_layer", None) is module and hasattr(wrapper, "lora_A"):
            raise ValueError(
                f"apply_expert_parallel: {name} is wrapped by a PEFT adapter ({type(wrapper).__name__}) that holds "
                f"factors for all experts; call apply_expert_parallel before get_peft_model"
            )
        if takes_every_token(module):
            _check_input_weighted_block(model, name, module, wrapper)
        num_experts = num_experts_of(module)
        if num_experts % ep_size:
            raise ValueError(
                f"apply_expert_parallel: {name} has E={num_experts} experts, not divisible by the EP size W={ep_size}"
            )
        local = num_experts // ep_size
        checked.shards.append(
            ExpertShard(name, num_experts, local, ep_rank * local, (ep_rank + 1) * local, ep_rank, ep_size)
        )
        if not isinstance(module, nn.ModuleList):
            family_compute_dtype(module)  # found before sharding: the family's forward may expect every expert
        if config.replicas:
            _check_replicas(name, module)
        transport, reason = _resolve_transport(module, config)
        checked.transport.append(transport)
        if reason is not None:
            checked.declined_fused[name] = reason
        checked.returns_logits.append(isinstance(module, nn.ModuleList) and _block_returns_router_logits(name, owner))
    experts = found[0][1]
    if any(p.is_meta for p in experts.parameters()):  # epmoe.from_pretrained: no kernel to ask about yet
        checked.backend, checked.declined_backends = None, []  # each forward chooses, as always
        return checked
    statuses = experts_gmm_backends(experts)  # judged once: the choice and the declined ones' reasons
    checked.backend = choose_backend(statuses, backend=config.gmm_backend)  # a named backend that declines raises here
    checked.declined_backends = [f"{s.name}: {s.reason}" for s in statuses if not s.eligible]
    return checked


def _two_level(
    group, ep_rank: int, nodes_by_rank: list[int], config: ExpertParallelConfig, checked: _Checked, found: list
) -> tuple[NodeLayout, NodeGroups] | None:
    """The EP group's node layout and this rank's groups of the two-level exchange, where the one
    decision (:func:`~epmoe.ep.topology.two_level_layout`) has the group run it and its modules can,
    their transports set to ``"nodes"``; ``None`` elsewhere. Collective over the EP group (every rank
    decides alike: the config, the modules and the layout are agreed)."""
    layout = two_level_layout(config, nodes_by_rank, ep_rank)
    if layout is None:
        return None
    for i, (name, module, _) in enumerate(found):
        reason = static_ineligible_reason(module)  # both need the routed MLP op and no per-source split
        if reason is not None and config.dispatch == "nodes":
            raise ValueError(
                f"apply_expert_parallel: dispatch='nodes' cannot run {type(module).__name__} at {name}: {reason}"
            )
        if reason is None:
            checked.transport[i] = "nodes"
    if "nodes" not in checked.transport:
        return None
    return layout, NodeGroups.make(group, layout, ep_rank, step_timeout_s(config.timeout, group))


def _probe_weight(experts: nn.Module) -> torch.Tensor:
    """One expert's first projection, ``(out, in)`` or ``(in, out)`` (on the meta device too): the
    shape and dtype the link costs' timed matmul takes (:func:`~epmoe.ep.links.link_costs`)."""
    if isinstance(experts, nn.ModuleList):
        return next(p for p in experts[0].parameters() if p.dim() == 2)
    name, rows = expert_rows(experts)[0]
    weight = experts.get_parameter(name)
    return weight[0] if rows == 1 else weight[:rows]


def _check_replicas(name: str, experts: nn.Module) -> None:
    """``ValueError`` naming the experts module and why, unless its experts run ``epmoe::routed_mlp``,
    whose weights expert replicas extend (:mod:`epmoe.ep.replicas`)."""
    post = None if isinstance(experts, nn.ModuleList) else per_expert_post(experts)
    reason = LocalExperts(experts, post=post).why_not_lean()
    if reason is not None:
        raise ValueError(
            f"ExpertParallelConfig(replicas): {type(experts).__name__} at {name} cannot lend its experts to "
            f"other ranks: {reason}; use replicas=0 for this model"
        )


def _check_input_weighted_block(model: nn.Module, name: str, experts: nn.Module, block: nn.Module | None) -> None:
    """``ValueError`` naming the experts class, path and reason unless the block of experts that take
    every token is one :mod:`epmoe.integrations.input_weighted` runs (checked on a probe)."""
    reason = input_weighted_block_reason(block, experts) if block is not None else "they sit in no block"
    if reason is not None:
        raise ValueError(
            f"apply_expert_parallel(model): {type(model).__name__} holds experts epmoe cannot run, "
            f"nothing was changed: {type(experts).__name__} at {name} (1 module; its forward takes "
            f"every token for every expert): {reason}"
        )


def _refusal(model: nn.Module, found: list[tuple[str, nn.Module, nn.Module]]) -> str | None:
    """The message refusing ``model`` where it holds experts epmoe cannot run
    (:func:`~epmoe.ep.recognize.unsupported_experts`) or would not run as their own forward does
    (:func:`~epmoe.ep.contract.unfaithful_experts`), naming each such experts class once with its
    first module path and the reason; ``None`` where there are none."""
    by_class: dict[str, tuple[str, str, int]] = {}
    for name, module, reason in [*unsupported_experts(model, found), *unfaithful_experts(found)]:
        later = served_from(module)
        reason = f"{reason}; {later}" if later else reason
        first = by_class.setdefault(type(module).__name__, (name, reason, 0))
        by_class[type(module).__name__] = (first[0], first[1], first[2] + 1)
    if not by_class:
        return None
    parts = [
        f"{cls} at {name} ({count} module{'s' if count > 1 else ''}): {reason}"
        for cls, (name, reason, count) in by_class.items()
    ]
    return (
        f"apply_expert_parallel(model): {type(model).__name__} holds experts epmoe cannot run, nothing was "
        f"changed: " + "; ".join(parts)
    )


def _check_ranks_agree(
    group: dist.ProcessGroup | None,
    ep_size: int,
    config: ExpertParallelConfig,
    found: list[tuple[str, nn.Module, nn.Module]],
    error: Exception | None,
) -> None:
    """Raise on every rank if any rank's validation failed or the ranks disagree on the config or the
    experts modules (their names, number of experts, and every parameter's name, shape and dtype),
    naming what differs: otherwise they would issue mismatched collectives later (an abort inside
    the backend, a wait until the group's timeout, or silently wrong rows). One agreement step on
    the EP group (:meth:`~epmoe.comm.steps.StepChannel.agree`; none for a group of one)."""
    if ep_size > 1:
        names = [f"config.{f.name} (here {getattr(config, f.name)!r})" for f in dataclasses.fields(config)] + [
            "experts modules (names)",
            "experts modules' numbers of experts",
            "experts' parameter names and shapes",
            "experts' dtype",
            "experts' parameter dtypes",
        ]
        values = [0] * len(names)  # a rank whose validation failed shows nothing (its modules may be broken)
        if error is None:
            layouts = [_parameter_layout(module) for _, module, _ in found]
            dtypes = [dtype for layout in layouts for _, _, dtype in layout]
            values = [value_code(getattr(config, f.name)) for f in dataclasses.fields(config)] + [
                value_code([name for name, _, _ in found]),
                value_code([num_experts_of(m) for _, m, _ in found]),
                value_code([[(n, s) for n, s, _ in layout] for layout in layouts]),
                dtype_code(dtypes[0]) if dtypes else 0,
                value_code([str(d) for d in dtypes]),
            ]
        fields = list(zip(names, values))
        channel = StepChannel(group, len(fields), timeout_s=step_timeout_s(config.timeout, group), what="EP")

        def show(name: str, value: int) -> str | None:
            return dtype_name(value) if name == "experts' dtype" else None

        channel.agree(
            channel.next_call(AGREE),
            platform.group_device(group),
            fields,
            failed=error is not None,
            caller="apply_expert_parallel",
            show=show,
        )
    if error is not None:
        raise error


def _unservable(model: nn.Module) -> str | None:
    """Why epmoe applies no EP to ``model`` as a whole: an untested transformers release
    (:mod:`epmoe.integrations.releases`), or transformers' own EP applied at load; else ``None``."""
    release = untested_release(model)
    if release is not None:
        return f"apply_expert_parallel(model): {type(model).__name__}: {release}"
    return _loaded_expert_parallel(model)


def _loaded_expert_parallel(model: nn.Module) -> str | None:
    """The refusal of a model transformers' own expert parallelism sharded at load
    (``from_pretrained(..., distributed_config=DistributedConfig(ep_size > 1))``), or ``None``."""
    config = next(
        (m.config for m in model.modules() if hasattr(getattr(m, "config", None), "distributed_config")), None
    )
    distributed = getattr(config, "distributed_config", None)
    ep_size, tp_size = (getattr(distributed, key, None) or 1 for key in ("ep_size", "tp_size"))
    if ep_size <= 1 and tp_size <= 1:
        return None
    return (
        f"apply_expert_parallel(model): {type(model).__name__} was loaded with transformers' own expert "
        f"or tensor parallelism (distributed_config with ep_size={ep_size}, tp_size={tp_size}): its experts are "
        f"sharded already and would be sharded twice. One change moves the load to epmoe: model, shards = "
        f"epmoe.from_pretrained("
        f"ModelClass, path, distributed_config=...) with the same DistributedConfig, in place of "
        f"ModelClass.from_pretrained(path, distributed_config=...)"
    )


def _data_parallel_wrapper(module: nn.Module) -> str | None:
    """The name of the data-parallel wrapper ``module`` is (DDP, FSDP2, FSDP), or ``None``."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return None
    if isinstance(module, FSDPModule):
        return "FSDP2 (fully_shard)"
    if isinstance(module, FullyShardedDataParallel):
        return "FullyShardedDataParallel"
    return None


def _parameter_layout(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every parameter of an experts module, before sharding."""
    return [(name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()]


def _resolve_transport(experts: nn.Module, config: ExpertParallelConfig) -> tuple[str, str | None]:
    """``(transport, why a requested fused transport was declined or None)`` for one module:
    ``"fused"`` where ``dispatch="fused"`` asked for it and the fused ops can run these experts, else
    ``"alltoallv"``; ``"auto"`` is ``"alltoallv"`` on every device (why: :mod:`epmoe.ep.dispatch`);
    ``"static"`` where asked for, ``ValueError`` where it cannot run these experts."""
    if config.dispatch == "static":
        reason = static_ineligible_reason(experts)
        if reason is not None:
            raise ValueError(
                f"apply_expert_parallel: dispatch='static' cannot run {type(experts).__name__}: {reason}; "
                f"use dispatch='alltoallv'"
            )
        return "static", None
    if config.dispatch != "fused" or config.capacity_factor is not None:  # capacity: see the config
        return "alltoallv", None
    reason = fused_ineligible_reason(experts)
    if reason is None:
        weight = experts.down_proj
        computed = family_compute_dtype(experts)
        if computed is not None and torch.promote_types(computed, weight.dtype) != weight.dtype:
            reason = (
                f"its own forward computes its experts in {torch.promote_types(computed, weight.dtype)}, "
                f"its weights are {weight.dtype}: the fused ops run one dtype"
            )
    return ("fused", None) if reason is None else ("alltoallv", reason)


def _shard_parameters(
    module: nn.Module, shard: ExpertShard, tied: dict[int, nn.Parameter]
) -> tuple[tuple[str, ...], dict[str, int]]:
    """Keep experts ``[local_start, local_end)`` of every per-expert parameter (weights and biases,
    rows ``[j*rows, (j+1)*rows)`` for expert ``j``: :func:`~epmoe.ep.recognize.expert_rows`); return
    their names, and the rows past all experts' that were dropped (zero-computation experts', never
    read) by name. ``tied`` maps each parameter sharded so far to its shard, so a parameter shared by
    two experts modules gets one shard, shared as before."""
    if shard.ep_size == 1:
        return (), {}
    names, unread = [], {}
    for name, rows in expert_rows(module):
        param = module.get_parameter(name)
        if id(param) not in tied:
            local = param.detach()[shard.local_start * rows : shard.local_end * rows].clone()
            tied[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
        if param.shape[0] > shard.num_experts * rows:
            unread[name] = param.shape[0] - shard.num_experts * rows
        set_parameter(module, name, tied[id(param)])
        names.append(name)
    return tuple(names), unread


def _unsharded_shapes(found: list[tuple[str, nn.Module, nn.Module]]) -> dict[tuple[str, str], tuple[int, ...]]:
    """``(experts module name, parameter name) -> shape`` of every per-expert parameter of packed
    experts (:func:`~epmoe.ep.recognize.expert_rows`), read before sharding."""
    return {
        (name, param): tuple(module.get_parameter(param).shape)
        for name, module, _ in found
        if not isinstance(module, nn.ModuleList)
        for param, _ in expert_rows(module)
    }


def _check_shard_marks(model: nn.Module, unsharded: dict[tuple[str, str], tuple[int, ...]]) -> None:
    """``ValueError`` naming the module path, the parameter and both shapes where a sharded
    parameter's :class:`~epmoe.ep.shard_mark.ShardMark` (read from the experts' row layout) does not
    give the unsharded parameter's shape (``unsharded``, read before sharding), so that nothing that
    joins by the mark (:func:`epmoe.checkpoint.save.whole_state_dict`, a framework that gathers)
    rebuilds another tensor. Local: every rank reads the same from its own model, no collective."""
    for _, module, state in sharded_experts(model, packed_only=True):
        for name in state.sharded_names:
            marked = tuple(mark_of(module.get_parameter(name)).global_shape)
            before = unsharded[(state.shard.module_name, name)]
            if marked != before:
                raise ValueError(
                    f"apply_expert_parallel: {state.shard.module_name}: the ShardMark of {name} says its unsharded "
                    f"tensor is {marked}, but it was {before} before sharding"
                )


def _ancestors(modules: dict[str, nn.Module], name: str) -> tuple[nn.Module, ...]:
    """The modules from the root (``""``) down to ``name``, itself included."""
    parts = name.split(".")
    return tuple(modules[".".join(parts[:i])] for i in range(len(parts) + 1))


def _shard_module_list(experts: nn.ModuleList, shard: ExpertShard) -> nn.ModuleList:
    """Replace other ranks' experts by placeholders; return the local ones (an unregistered list)."""
    for index in range(shard.num_experts):
        if not shard.local_start <= index < shard.local_end:
            experts[index] = NonLocalExpert(index // shard.num_local_experts)
    return nn.ModuleList(experts[shard.local_start : shard.local_end])


def _block_returns_router_logits(name: str, block: nn.Module) -> bool:
    """Whether the block's own forward returns ``(hidden, router_logits)`` (transformers 4.x style):
    probed once, on one zero token, before anything is changed. Also checks that the block has what
    the EP block forward needs (a router, a top-k)."""
    block_top_k(block)
    router = block_router(block)
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"apply_expert_parallel: {name}: the router {type(router).__name__} needs a 2-D `weight` "
            f"(E, H) to size the probe input"
        )
    was_training = block.training
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # dropout / jitter must not consume the RNG
        block.eval()
        try:
            out = block(torch.zeros(1, 1, weight.shape[-1], dtype=weight.dtype, device=weight.device))
        except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward, reported by name
            raise ValueError(
                f"apply_expert_parallel: {name}: the block's own forward failed on a probe token: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            block.train(was_training)
    return isinstance(out, tuple)
