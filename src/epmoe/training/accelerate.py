"""``prepare_accelerator``: an accelerate ``Accelerator`` training an EP model, exact.

``accelerator.prepare`` wraps the model in ``DistributedDataParallel`` (which leaves the expert
parameters alone, :mod:`epmoe.ep.params`) or, with accelerate's FSDP2 plugin, in ``fully_shard``
(which must be told to ignore the experts: its plugin's ``ignored_modules``). What is
not right on its own is ``accelerator.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` (or its
DTensor-aware variant), whose norm on each rank sees only that rank's experts. ``prepare_accelerator``
replaces that one method *of this accelerator* (the class is untouched) by
:func:`epmoe.clip_grad_norm_` after accelerate's own ``unscale_gradients``. Without it, the step
guard (:mod:`epmoe.ep.guard`) raises at the next forward.

With accelerate's DeepSpeed plugin (ZeRO stage 1, 2 or 3) the DeepSpeed path of
:mod:`epmoe.training.deepspeed` is taken instead: this accelerator's ``prepare`` runs
:func:`epmoe.prepare_deepspeed` on every EP model it is given and moves the expert parameters of
every torch optimizer it is given into DeepSpeed's MoE param groups (what
``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` makes; an optimizer
named in the DeepSpeed config, ``DummyOptim``, DeepSpeed splits itself), before accelerate calls
``deepspeed.initialize``. DeepSpeed then reduces, averages and clips every gradient itself (its
``accelerator.clip_grad_norm_`` returns the engine's norm). Both replaced methods are in the
launcher table (:mod:`epmoe.training.launchers`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from epmoe.ep.state import ep_states
from epmoe.training.deepspeed import MARKER, check_plugin, prepare_deepspeed, split_moe_param_groups
from epmoe.training.launchers import accelerator_clip, remember, remembered, replace

PREPARED = "prepare_accelerator"


def prepare_accelerator(accelerator: Any) -> Any:
    """Make ``accelerator`` (an ``accelerate.Accelerator``) train an EP model exactly; returns it.

    Call once on every rank, before the training loop: before or after ``accelerator.prepare``
    (DDP, FSDP2), before it (DeepSpeed, whose engine is built there). Idempotent. FSDP1 (it shards
    every parameter, experts included) and DeepSpeed ZeRO stage 3 with parameter or optimizer offload
    to NVMe raise ``ValueError``.
    """
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - accelerate is what the caller hands in
        Accelerator = None
    if Accelerator is None or not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"prepare_accelerator(accelerator): expected an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    refuse_fsdp1(accelerator, "prepare_accelerator")
    if remembered(accelerator, PREPARED):
        return accelerator
    if str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED"):
        _prepare_deepspeed_path(accelerator)
    else:
        replace(accelerator, "clip_grad_norm_", accelerator_clip(accelerator))
    remember(accelerator, PREPARED)
    return accelerator


def _prepare_deepspeed_path(accelerator: Any) -> None:
    """Under accelerate's DeepSpeed plugin: this accelerator's ``prepare`` makes every EP model it is
    given DeepSpeed's (see the module docstring)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    check_plugin(plugin, "prepare_accelerator(accelerator)")
    engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    module = getattr(engine, "module", None)
    if isinstance(module, nn.Module) and any(True for _ in ep_states(module)) and not hasattr(module, MARKER):
        raise ValueError(
            "prepare_accelerator(accelerator): accelerator.prepare has already built the DeepSpeed "
            "engine of an expert-parallel model without epmoe's expert groups; call "
            "epmoe.prepare_accelerator(accelerator) before accelerator.prepare"
        )
    prepare = accelerator.prepare

    def prepare_with_expert_groups(*args: Any, device_placement: Any = None) -> Any:
        for obj in args:
            if isinstance(obj, nn.Module) and any(True for _ in ep_states(obj)):
                prepare_deepspeed(obj)
        for obj in args:  # after the marks: the groups follow them
            split_moe_param_groups(obj, "prepare_accelerator")
        return prepare(*args, device_placement=device_placement)

    replace(accelerator, "prepare", prepare_with_expert_groups)


def refuse_fsdp1(accelerator: Any, caller: str) -> None:
    """``ValueError`` for an accelerator whose FSDP1 plugin would shard the experts."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if kind.endswith("FSDP") and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            f"{caller}: accelerate's FSDP1 shards every parameter, experts included, which differ per "
            f"EP rank; use FSDP2 (fsdp_version=2, FSDP_VERSION=2), whose ignored modules keep them out"
        )
