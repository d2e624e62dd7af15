"""``prepare_accelerator``: an accelerate ``Accelerator`` training an EP model, exact.

``accelerator.prepare`` wraps the model in ``DistributedDataParallel`` (which leaves the expert
parameters alone, :mod:`epmoe.ep.params`) or, with accelerate's FSDP2 plugin, in ``fully_shard``
(which must be told to ignore the experts: its plugin's ``ignored_modules``). What is
not right on its own is ``accelerator.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` (or its
DTensor-aware variant), whose norm on each rank sees only that rank's experts. ``prepare_accelerator``
replaces that one method *of this accelerator* (the class is untouched) by
:func:`epmoe.clip_grad_norm_` after accelerate's own ``unscale_gradients``. Without it, the step
guard (:mod:`epmoe.ep.guard`) raises at the next forward.
"""

from __future__ import annotations

from typing import Any

from epmoe.training.clip import clip_grad_norm_


def prepare_accelerator(accelerator: Any) -> Any:
    """Make ``accelerator`` (an ``accelerate.Accelerator``) clip an EP model exactly; returns it.

    Call once on every rank, before the training loop (before or after ``accelerator.prepare``).
    Idempotent. DeepSpeed and FSDP1 (they shard every parameter, experts included) raise ``ValueError``.
    """
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover - accelerate is what the caller hands in
        Accelerator = None
    if Accelerator is None or not isinstance(accelerator, Accelerator):
        raise TypeError(f"prepare_accelerator(accelerator): expected an accelerate.Accelerator, got "
                        f"{type(accelerator).__name__}")
    refuse_sharding_all(accelerator, "prepare_accelerator")
    if getattr(accelerator, "_epmoe_prepared", False):
        return accelerator

    def clip(parameters, max_norm, norm_type=2):
        accelerator.unscale_gradients()  # what accelerate's own clip_grad_norm_ does first
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip
    accelerator._epmoe_prepared = True
    return accelerator


def refuse_sharding_all(accelerator: Any, caller: str) -> None:
    """``ValueError`` for an accelerator whose plugin would shard the experts (DeepSpeed, FSDP1)."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    if kind.endswith("DEEPSPEED"):
        raise ValueError(f"{caller}: DeepSpeed shards every parameter, experts included, which differ per EP rank; "
                         f"use DDP (accelerate's default) or FSDP2 (fsdp_version=2)")
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if kind.endswith("FSDP") and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(f"{caller}: accelerate's FSDP1 shards every parameter, experts included, which differ per "
                         f"EP rank; use FSDP2 (fsdp_version=2, FSDP_VERSION=2), whose ignored modules keep them out")
