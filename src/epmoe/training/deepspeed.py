"""``prepare_deepspeed``: DeepSpeed ZeRO stages 1, 2 and 3 on an EP model, exact, through DeepSpeed's own MoE support.

DeepSpeed treats a parameter as an expert parameter when it carries ``allreduce = False`` and a
``group_name`` (``deepspeed.moe.utils.is_moe_param``): its engine broadcasts it at start-up over
that name's expert-data-parallel group only (``_broadcast_model``), ZeRO 1/2 put it in an optimizer
param group of its own (``'moe': True``) partitioned and reduced over that group
(``stage_1_and_2``), and the gradient norm counts every expert once. The engine turns this on only
for a model holding one of its ``MoE`` layers (``has_moe_layers``), and creates the groups by
calling each such layer's ``set_deepspeed_parallelism``. :func:`prepare_deepspeed` therefore

* marks every expert parameter ``allreduce = False``, ``group_name = "ep_size_<EP>"`` (DeepSpeed's
  own name for an EP size);
* adds one parameter-free :class:`DeepSpeedExpertGroups` (a DeepSpeed MoE layer that holds no
  computation: an ``AutoEPMoELayer``, or ``deepspeed.moe.layer.MoE`` before DeepSpeed had AutoEP) to
  the model, as ``model.epmoe_deepspeed``. When the engine calls its
  ``set_deepspeed_parallelism`` it creates DeepSpeed's expert and expert-data-parallel groups with
  ``deepspeed.utils.groups._create_expert_and_data_parallel`` (what DeepSpeed's ``MoE`` layers call),
  checks that they are epmoe's (the EP group; the ``"dp"`` replicas of this rank's experts, a group
  of one without an EP x DP mesh) and hands the expert gradients' reduction to DeepSpeed
  (:meth:`epmoe.ep.grads.ExpertGradPolicy.hand_over`). There too, before DeepSpeed looks at the optimizer it
  was given, that optimizer's param groups are checked (:func:`check_moe_param_groups`): expert
  parameters outside DeepSpeed's MoE groups raise ``ValueError`` naming the fix, in place of
  DeepSpeed's own assertion (or, with some groups split, its silently wrong reduction).

Why that is exact: after the backward all-to-all an expert's gradient is the sum over every EP
rank's tokens. DeepSpeed divides every gradient, experts included, by its data-parallel size (the
world) and sums expert gradients over the expert-data-parallel group: the gradient of the mean
over ranks of each rank's loss, which is what the same recipe without EP computes for every
parameter (``expert_grad="mean"``; epmoe itself then neither reduces nor scales them). Clipping:
ZeRO's norm sums each rank's partition over all ranks, so each expert (held by one EP rank,
partitioned over its replicas) is counted once.

ZeRO stage 3 (DeepSpeed 0.19 and later): DeepSpeed partitions a parameter whose
``ds_zero_placement_family`` is ``"autoep_expert"`` over the expert-data-parallel group its
``ds_zero_partition_group_name`` names (its own AutoEP's placement, resolved in the engine's
``_resolve_zero3_param_placement``), every other parameter over all ranks; it divides expert
gradients by the data-parallel size too and reduce-scatters them over that group, and its norm adds
each expert partition once. :func:`prepare_deepspeed` sets those two marks on the expert parameters,
and :class:`DeepSpeedExpertGroups` is an ``AutoEPMoELayer`` there (the engine refuses its native
``MoE`` layers under stage 3): the same arithmetic as stages 1 and 2, each rank's experts
partitioned over its ``"dp"`` replicas only (kept whole without an EP x DP mesh)::

    EP 2 x DP 2 (ranks 0,1 | 2,3 EP groups; 0,2 | 1,3 "dp")   experts 0-3 on ranks 0 and 2, 4-7 on 1 and 3
    non-expert parameter p      rank r holds p's r-th quarter, gathered over all 4 ranks in forward
    experts 0-3 of a layer      rank 0 the first half, rank 2 the second, gathered over {0, 2} in forward

ZeRO-3's pre-forward hook gathers a module's parameters before its forward runs, the experts
module's included, so epmoe's experts forward reads the gathered weights. Saving: outside a forward
the parameters are partitions, so the model's ``save_pretrained`` (every rank) gathers every
parameter first (each rank then holds the non-expert parameters and its own experts whole, as
without ZeRO) and writes the complete checkpoint; a prepared Trainer's ``save_model`` goes through
it. Parameter and optimizer offload to ``"cpu"`` (``offload_param``, ``offload_optimizer``) change
where DeepSpeed keeps the partitions, not what it computes: exact too. Refused inside
``deepspeed.initialize`` (before the first step) under stage 3: offload to NVMe (a Trainer or
accelerator already at ``prepare_trainer`` / ``prepare_accelerator``), a PEFT model (LoRA on the
experts or elsewhere: not tested under ZeRO-3, and peft's ``save_pretrained`` would read partitions),
and a DeepSpeed without AutoEP.

Refused: ``expert_grad="sum"`` (DeepSpeed divides every gradient), DeepSpeed's data-before-expert
layout and model parallelism. DeepSpeed's own checkpoints (``engine.save_checkpoint``) write each
expert layer through its ``MoE`` layer's parameters, which epmoe's experts are not: save with
``model.save_pretrained`` (every rank) or, at stages 1 and 2, :func:`epmoe.get_state_dict` and
``torch.distributed.checkpoint`` instead.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe.checkpoint.save import SavePretrained
from epmoe.ep.lora import clear_full_shapes
from epmoe.ep.model import DEEPSPEED_EXPERT_FAMILY
from epmoe.ep.params import expert_parameters
from epmoe.ep.state import ep_model, require_ep_states
from epmoe.integrations.peft import has_expert_lora
from epmoe.training.launchers import replace

MARKER = "epmoe_deepspeed"  # the DeepSpeedExpertGroups child of a prepared model
REDUCER = "DeepSpeed"


def prepare_deepspeed(model: nn.Module) -> nn.Module:
    """Make ``model`` (expert-parallel, or a PeftModel around one) exact under DeepSpeed ZeRO stage 1, 2 or
    3 (3: not a PeftModel, refused inside ``deepspeed.initialize``); returns it.

    Call on every rank after :func:`epmoe.apply_expert_parallel` (and after adding LoRA factors to
    the experts, if any) and before ``deepspeed.initialize(model=model, ...)``. Idempotent. Give
    DeepSpeed the optimizer in its config (``"optimizer"``, built from ``model_parameters=list(...)``)
    or an optimizer whose param groups went through
    ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` (any other torch
    optimizer raises ``ValueError`` inside ``deepspeed.initialize``, naming this fix). The model's
    ``save_pretrained`` becomes :class:`GatheredSavePretrained` (ZeRO-3's partitions gathered first).
    """
    states = [state for _, state in require_ep_states(model, "prepare_deepspeed")]
    ep_models = list({id(s.model): s.model for s in states if s.model.sharded}.values())
    if not ep_models:
        return model  # EP size 1: nothing is sharded, DeepSpeed's data parallelism is right as it is
    if len(ep_models) > 1:
        raise ValueError(
            "prepare_deepspeed(model): the model holds experts of more than one expert-parallel "
            "application; apply_expert_parallel once to the whole model"
        )
    sync = ep_models[0].policy
    if sync.mode == "sum":
        raise ValueError(
            "prepare_deepspeed(model): DeepSpeed divides every gradient by the data-parallel size, expert "
            "gradients included, so ExpertParallelConfig(expert_grad='sum') cannot be honoured; use 'auto' or 'mean'"
        )
    if sync.wrapper is not None and sync.wrapper != REDUCER:
        raise ValueError(
            f"prepare_deepspeed(model): the model already ran under {sync.wrapper}; DeepSpeed would "
            f"average its expert gradients again"
        )
    name = group_name(sync.ep_size)
    for p in expert_parameters(model):  # LoRA factors on the experts narrowed to this rank's first
        p.allreduce = False
        p.group_name = name
        p.ds_zero_placement_family = DEEPSPEED_EXPERT_FAMILY  # ZeRO-3: partitioned over the expert-data-parallel group
        p.ds_zero_partition_group_name = name
    clear_full_shapes(model)  # DeepSpeed reads ds_shape as ZeRO-3's (e.g. its checkpoints' param_shapes)
    if not isinstance(getattr(model, MARKER, None), _groups_class()):
        model.add_module(MARKER, _groups_class()(model, sync.ep_size, _num_experts(states)))
    save = getattr(model, "save_pretrained", None)
    if isinstance(save, SavePretrained) and not isinstance(save, GatheredSavePretrained):
        model.save_pretrained = GatheredSavePretrained(model)
    return model


class GatheredSavePretrained(SavePretrained):
    """``save_pretrained`` of a model :func:`prepare_deepspeed` prepared: under ZeRO stage 3 (its
    parameters are partitions outside a forward) every parameter is gathered first, with
    ``deepspeed.zero.GatheredParameters`` (the experts over their expert-data-parallel group, the
    rest over all ranks), for the EP model's own save; otherwise that save as it is. Every rank calls
    it, as any EP model's ``save_pretrained``."""

    def __call__(self, save_directory, *args: Any, **kwargs: Any) -> Any:
        partitioned = [p for p in self.model.parameters() if hasattr(p, "ds_id")]
        if not partitioned:
            return super().__call__(save_directory, *args, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            return super().__call__(save_directory, *args, **kwargs)


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert and expert-data-parallel groups of an EP size."""
    return f"ep_size_{ep_size}"


def _num_experts(states: list) -> int:
    return max(state.shard.num_experts for state in states)


def split_moe_param_groups(optimizer: Any, caller: str) -> None:
    """Move the expert parameters of ``optimizer`` (a torch optimizer that has not stepped) into
    DeepSpeed's MoE param groups with DeepSpeed's own helper,
    ``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` (``'moe': True``,
    ``'name'``: their group name, each group's options kept, split at its ``max_group_size``); groups
    it leaves empty are dropped. An optimizer that already has MoE groups, or holds no expert
    parameter, is left as it is (:func:`check_moe_param_groups` then judges it), and so is anything
    but a torch optimizer (accelerate's ``DummyOptim``: DeepSpeed splits the config's optimizer's
    parameters itself). ``caller`` names the public function in errors."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    groups = optimizer.param_groups
    if any(group.get("moe", False) for group in groups) or not any(_is_marked(p) for g in groups for p in g["params"]):
        return
    if optimizer.state:
        raise ValueError(f"{caller}: the optimizer has already stepped; prepare before training")
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    unnamed = [f"{_UNNAMED}{index}" for index in range(len(groups))]  # the helper keys groups by name
    named = [
        {**group, "params": list(group["params"]), "name": group.get("name", label)}
        for group, label in zip(groups, unnamed)
    ]
    split = split_params_into_different_moe_groups_for_optimizer(named)
    optimizer.param_groups = []
    for group in split:
        if not group["params"]:
            continue
        if group["name"] in unnamed:
            del group["name"]
        optimizer.add_param_group(group)


_UNNAMED = "epmoe: unnamed param group "


def _is_marked(p: Any) -> bool:
    """Whether ``p`` is marked as a DeepSpeed expert parameter (``deepspeed.moe.utils.is_moe_param``)."""
    return getattr(p, "allreduce", True) is False and hasattr(p, "group_name")


def check_moe_param_groups(param_groups: Any, caller: str) -> None:
    """``ValueError`` naming the fix unless every param group holding expert parameters (marked by
    :func:`prepare_deepspeed`) is one of DeepSpeed's MoE groups holding only those: DeepSpeed would
    otherwise partition and reduce the experts as replicated parameters, or stop at its own
    assertion that no param group is marked as MoE."""
    for index, group in enumerate(param_groups):
        params = group["params"] if isinstance(group, dict) else [group]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        marked = [_is_marked(p) for p in params]
        moe = isinstance(group, dict) and bool(group.get("moe", False))
        if (moe and not all(marked)) or (not moe and any(marked)):
            what = (
                "mixes expert and non-expert parameters in a MoE group"
                if moe
                else "holds expert parameters outside DeepSpeed MoE groups"
            )
            raise ValueError(
                f"{caller}: param group {index} of the optimizer given to DeepSpeed {what}: DeepSpeed would "
                f"partition and reduce the experts, which differ on every EP rank, as replicated parameters. Call "
                f"epmoe.prepare_deepspeed(model) first, then build the optimizer from "
                f"deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(param_groups) (or name "
                f"the optimizer in the DeepSpeed config; a Trainer: epmoe.prepare_trainer(trainer), an accelerator: "
                f"epmoe.prepare_accelerator(accelerator) before accelerator.prepare)"
            )


OFFLOADS = ("offload_param", "offload_optimizer")  # ZeRO-3 options: device "cpu" is exact, "nvme" refused


def check_zero_config(zero: Any, caller: str) -> None:
    """``ValueError`` for a DeepSpeed ``zero_optimization`` config (a dict, or DeepSpeed's own config
    object) that epmoe cannot train exactly: stage 3 with a DeepSpeed without AutoEP (no expert
    placement under ZeRO-3), or with parameter or optimizer offload to NVMe (offload to ``"cpu"`` is
    exact). ``caller`` names the public function in errors."""
    read = zero.get if isinstance(zero, dict) else lambda name, default=None: getattr(zero, name, default)
    stage = getattr(read("stage"), "value", read("stage"))
    if stage != 3:
        return
    if not _has_autoep():
        raise ValueError(
            f"{caller}: DeepSpeed ZeRO stage 3 places expert parameters only from DeepSpeed 0.19 on "
            f"(deepspeed.module_inject.auto_ep_layer); upgrade DeepSpeed or use ZeRO stage 1 or 2"
        )
    for option in OFFLOADS:
        settings = read(option)
        device = settings.get("device", "none") if isinstance(settings, dict) else getattr(settings, "device", "none")
        device = getattr(device, "value", device)
        if device not in (None, "none", "cpu"):
            raise ValueError(
                f"{caller}: DeepSpeed ZeRO stage 3 with zero_optimization.{option} (device {device!r}) is not "
                f"supported on an expert-parallel model; offload to device 'cpu', or remove {option}"
            )


def check_plugin(plugin: Any, caller: str) -> None:
    """:func:`check_zero_config` on an accelerate ``DeepSpeedPlugin``'s config (``None``: no plugin)."""
    config = getattr(plugin, "deepspeed_config", None)
    if isinstance(config, dict):
        check_zero_config(config.get("zero_optimization") or {}, caller)


@functools.cache
def _has_autoep() -> bool:
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer  # noqa: F401
    except ImportError:
        return False
    return True


def _calling_engine() -> Any:
    """The DeepSpeed engine whose construction is on the stack (it calls ``set_deepspeed_parallelism``
    from ``_configure_distributed_model``, see the launcher table), or ``None``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, DeepSpeedEngine):
            return candidate
        frame = frame.f_back
    return None


def _check_and_hand_over(root: nn.Module, name: str) -> None:
    """Check that DeepSpeed's expert groups named ``name`` are those of ``root``'s EP model, and hand
    the expert gradients' reduction to DeepSpeed (its engine reduces and averages them)."""
    from deepspeed.utils import groups

    model = ep_model(root)
    policy = model.policy
    ours_ep = dist.get_process_group_ranks(model.group if model.group is not None else dist.group.WORLD)
    ours_dp = (
        dist.get_process_group_ranks(policy.dp_channel.group) if policy.dp_channel is not None else [dist.get_rank()]
    )
    theirs_ep = dist.get_process_group_ranks(groups._get_expert_parallel_group(name))
    theirs_dp = dist.get_process_group_ranks(groups._get_expert_data_parallel_group(name))
    if sorted(ours_ep) != sorted(theirs_ep) or sorted(ours_dp) != sorted(theirs_dp):
        raise ValueError(
            f"prepare_deepspeed: DeepSpeed's expert groups (EP {theirs_ep}, expert data parallel "
            f"{theirs_dp}) are not epmoe's (EP {ours_ep}, 'dp' replicas {ours_dp}) on rank "
            f"{dist.get_rank()}: build the EP group as DeepSpeed lays it out (consecutive ranks, the "
            f"('dp', 'ep') DeviceMesh of init_device_mesh, or the default group)"
        )
    world = dist.get_world_size()
    if world != policy.data_parallel_size:
        raise ValueError(
            f"prepare_deepspeed: DeepSpeed runs over {world} ranks but the experts are "
            f"sharded over {policy.ep_size} and replicated over {policy.dp_size}"
        )
    policy.hand_over(REDUCER)


@functools.cache
def _groups_class() -> type:
    """:class:`DeepSpeedExpertGroups`, built on first use (deepspeed is an optional dependency)."""
    try:
        if _has_autoep():  # the engine accepts these under ZeRO stage 3 too
            from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer as Base
        else:
            from deepspeed.moe.layer import MoE as Base
    except ImportError as error:
        raise ImportError("prepare_deepspeed: deepspeed is not installed (pip install deepspeed)") from error

    class DeepSpeedExpertGroups(Base):
        """Tells DeepSpeed's engine that the model has expert parameters and creates their groups.

        A DeepSpeed MoE layer without parameters or computation: the engine enables its
        expert-parameter handling for a model holding one, and calls ``set_deepspeed_parallelism``
        on it before its start-up broadcast (see :mod:`epmoe.training.deepspeed`).
        """

        def __init__(self, root: nn.Module, ep_size: int, num_experts: int):
            nn.Module.__init__(self)  # MoE's own constructor builds a gate and experts: none here
            self.ep_size, self.num_experts = ep_size, num_experts
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = group_name(ep_size)
            self.enable_expert_tensor_parallelism, self.use_residual = False, False
            object.__setattr__(self, "_root", root)  # not a submodule: the model holding this one

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **kwargs: Any) -> None:
            from deepspeed.utils import groups

            _refuse_inexact_engine(self._root, use_data_before_expert_parallel_)
            name = self.expert_group_name
            if name not in groups._get_expert_parallel_group_dict():
                groups._create_expert_and_data_parallel(self.ep_size)
            _check_and_hand_over(self._root, name)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("DeepSpeedExpertGroups holds no computation: it only configures DeepSpeed")

        def extra_repr(self) -> str:
            return f"ep_size={self.ep_size}, group_name={self.expert_group_name!r}"

    DeepSpeedExpertGroups.__module__ = __name__
    return DeepSpeedExpertGroups


def _refuse_inexact_engine(root: nn.Module, use_data_before_expert_parallel_: bool) -> None:
    """``ValueError`` for what the DeepSpeed engine starting on ``root`` was configured with that it
    cannot run exactly on an EP model, before its groups are created or its optimizer partitions
    anything."""
    from deepspeed.utils import groups

    if use_data_before_expert_parallel_:
        raise ValueError(
            "prepare_deepspeed: DeepSpeed's use_data_before_expert_parallel_ layout is not "
            "epmoe's ('dp', 'ep') mesh; leave it off"
        )
    if groups.mpu is not None:
        raise ValueError(
            "prepare_deepspeed: DeepSpeed with model (tensor / pipeline) parallelism is not "
            "supported on an expert-parallel model"
        )
    engine = _calling_engine()
    if engine is not None:
        check_zero_config(engine._config.zero_config, "deepspeed.initialize on an EP model")
        if engine.zero_optimization_stage() == 3 and (has_expert_lora(root) or hasattr(root, "peft_config")):
            raise ValueError(
                "deepspeed.initialize on an EP model: DeepSpeed ZeRO stage 3 with a PEFT model "
                "(LoRA) around an expert-parallel model is not supported (its adapters would be "
                "saved from ZeRO-3's partitions); use ZeRO stage 1 or 2"
            )
    client_optimizer = getattr(engine, "client_optimizer", None)
    if isinstance(client_optimizer, torch.optim.Optimizer):  # before DeepSpeed's own checks of its groups
        check_moe_param_groups(client_optimizer.param_groups, "deepspeed.initialize on an EP model")


def prepare_deepspeed_trainer(trainer: Any) -> None:
    """What :func:`epmoe.prepare_trainer` does for a Trainer running DeepSpeed (``TrainingArguments(deepspeed=...)``):
    refuse what cannot be exact, :func:`prepare_deepspeed` on its model. The optimizer Trainer builds
    itself (no ``"optimizer"`` in the DeepSpeed config) gets DeepSpeed's expert param groups from the
    accelerator's ``prepare`` (:func:`epmoe.prepare_accelerator`, which ``prepare_trainer`` calls).
    DeepSpeed clips (``gradient_clipping``, Trainer's ``max_grad_norm``) and logs the whole model's
    norm itself. Under ZeRO stage 3 Trainer's ``save_model`` skips its DeepSpeed branch (DeepSpeed's
    16-bit gather holds rank 0's experts only, its fallback writes an engine checkpoint): every rank
    joins the model's ``save_pretrained``, which gathers the partitions (:class:`GatheredSavePretrained`)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    check_plugin(plugin, "prepare_trainer(trainer)")
    strategy = getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy)
    if strategy != "no":
        raise ValueError(
            "prepare_trainer(trainer): with DeepSpeed, Trainer checkpoints go through engine.save_checkpoint, which "
            "writes DeepSpeed's MoE layers' experts, not epmoe's: each rank's experts would be lost or mixed. Use "
            "TrainingArguments(save_strategy='no') and save with trainer.save_model() or model.save_pretrained (every rank)"
        )
    prepare_deepspeed(trainer.model)
    if getattr(plugin, "zero_stage", None) == 3:
        replace(
            trainer,
            "save_model",
            lambda output_dir=None, _internal_call=False: without_deepspeed_branch(
                trainer, type(trainer).save_model, trainer, output_dir, _internal_call=_internal_call
            ),
        )


def without_deepspeed_branch(trainer: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` (Trainer's own ``save_model``) through its plain branch: every rank
    joins the EP model's ``save_pretrained`` (Trainer's ``_save`` as :func:`epmoe.prepare_trainer`
    replaced it), which gathers ZeRO-3's partitions itself."""
    trainer.is_deepspeed_enabled = False
    try:
        return method(*args, **kwargs)
    finally:
        trainer.is_deepspeed_enabled = True
