"""``prepare_trainer``: transformers' ``Trainer`` (or any subclass) on an EP model, exact.

What Trainer does on its own is already right once :func:`epmoe.apply_expert_parallel` has run:
accelerate wraps the model in ``DistributedDataParallel``, which leaves the expert parameters alone
(:mod:`epmoe.ep.params`) and makes ``expert_grad="auto"`` mean over ranks
(:mod:`epmoe.ep.grads`); gradient accumulation, gradient checkpointing and ``evaluate`` need
nothing. One thing is not: Trainer clips with ``accelerator.clip_grad_norm_``, i.e.
``torch.nn.utils.clip_grad_norm_``, whose norm on each rank sees only that rank's experts, so every
rank would clip by a different factor and the replicated weights drift apart. ``prepare_trainer``
prepares this trainer's accelerator (:func:`epmoe.prepare_accelerator`: that one method *of this
accelerator*, the class untouched, becomes :func:`epmoe.clip_grad_norm_`), which also makes the
logged ``grad_norm`` the whole model's. And
Trainer saves (``save_model``, checkpoints) from the main process only, while the experts of an EP
model must be gathered from every rank: this trainer's ``_save`` lets the other ranks join the
model's ``save_pretrained`` (:mod:`epmoe.checkpoint.save`) without writing. Trainer checkpoints
(``save_strategy``) also get an ``epmoe_dcp/`` directory with the model and optimizer through
:func:`epmoe.get_state_dict` and ``torch.distributed.checkpoint``, written by a ``TrainerCallback``'s
``on_save`` (Trainer's own optimizer file holds rank 0's experts' moments only, and is not read), and
``resume_from_checkpoint`` loads both from it and the scheduler from Trainer's file, so a resumed run
continues exactly, at any world size. Which methods of this trainer are replaced, and why: the
launcher table, :mod:`epmoe.training.launchers`.

DeepSpeed (``TrainingArguments(deepspeed=...)``): ZeRO stages 1, 2 and 3 through DeepSpeed's own MoE
support, see :mod:`epmoe.training.deepspeed` (the expert param groups made at the accelerator's
``prepare``, :mod:`epmoe.training.accelerate`); there DeepSpeed clips and reduces, and Trainer
checkpoints are refused (``save_model`` works; under ZeRO-3 it gathers the partitions). accelerate's FSDP2 plugin
(``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``): its ``ignored_modules`` set to the
experts, Trainer's clip and saving routed as above, see :mod:`epmoe.training.fsdp`. FSDP1 shards
every parameter, experts included: refused; so are ZeRO-3 with NVMe offload, ``save_on_each_node`` and
``load_best_model_at_end`` (see the errors). An unsharded ``trainer.ref_model`` (TRL's DPO and GRPO
trainers load one from the policy's path when given ``ref_model=None``) is replaced by an EP twin with
its weights (:mod:`epmoe.training.reference`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from epmoe.checkpoint.dcp import get_state_dict, set_state_dict
from epmoe.checkpoint.save import SavePretrained, adapter_state_dict
from epmoe.checkpoint.state_dict_warning import own_state_dict
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.state import ep_states
from epmoe.integrations.peft import adapter_without_experts, has_expert_lora
from epmoe.training.accelerate import prepare_accelerator
from epmoe.training.deepspeed import prepare_deepspeed_trainer
from epmoe.training.fsdp import is_dtensor, prepare_fsdp_trainer, without_fsdp_branch
from epmoe.training.launchers import remember, remembered, replace
from epmoe.training.reference import reference_model

DCP_DIR = "epmoe_dcp"  # inside each Trainer checkpoint directory
SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME: the learning-rate scheduler's file
CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR: checkpoint-<step>
PREPARED = "prepare_trainer"


def prepare_trainer(trainer: Any) -> Any:
    """Make ``trainer`` (a ``transformers.Trainer`` or subclass, built on an EP model) exact; returns it.

    Call once, after building the trainer and before ``trainer.train()``. Idempotent.
    """
    accelerator = getattr(trainer, "accelerator", None)
    model = getattr(trainer, "model", None)
    if accelerator is None or not isinstance(model, nn.Module):
        raise TypeError(f"prepare_trainer(trainer): expected a transformers.Trainer, got {type(trainer).__name__}")
    states = [state for _, _, state in ep_states(model)]
    if not states:
        raise ValueError(
            "prepare_trainer(trainer): trainer.model is not expert-parallel; call "
            "epmoe.apply_expert_parallel(model) before building the Trainer"
        )
    deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
    fsdp = getattr(trainer, "is_fsdp_enabled", False)
    for option, why in (
        (
            "save_on_each_node",
            "each node's first rank would write a checkpoint, but the experts are gathered to global rank 0 only",
        ),
        (
            "load_best_model_at_end",
            "Trainer reloads the best checkpoint with load_state_dict of a full checkpoint into the sharded model",
        ),
    ):
        if getattr(trainer.args, option, False):
            raise ValueError(
                f"prepare_trainer(trainer): TrainingArguments({option}=True) is not supported on an "
                f"expert-parallel model: {why}"
            )
    if remembered(trainer, PREPARED):
        return trainer
    if deepspeed:  # DeepSpeed reduces, averages and clips the expert gradients itself
        prepare_deepspeed_trainer(trainer)
    if fsdp:  # FSDP2 told to leave the experts alone (epmoe.training.fsdp); FSDP1 refused there
        prepare_fsdp_trainer(trainer)
    if states[0].model.sharded and not deepspeed:  # one EPModel: every experts module's
        states[0].model.policy.set_wrapper("transformers.Trainer")
    prepare_accelerator(accelerator)  # its clip, or under DeepSpeed the expert groups at accelerator.prepare
    mixed_mesh = hasattr(trainer, "_mixed_mesh_grad_norm")  # transformers >= 5.17; before, it clips as above
    if mixed_mesh and not deepspeed and (fsdp or any(is_dtensor(p) for p in model.parameters())):
        # plain expert tensors next to FSDP2's DTensors: Trainer clips there without the accelerator
        clip = accelerator.clip_grad_norm_
        replace(trainer, "_mixed_mesh_grad_norm", lambda model, max_norm: clip(model.parameters(), max_norm))

    if not deepspeed and not fsdp:  # those prepare the reference themselves (sharded over every rank)
        _reference_stays_sharded(trainer, model)
    _save_from_every_rank(trainer, fsdp)
    if not deepspeed:  # DeepSpeed checkpoints are refused (epmoe.training.deepspeed)
        trainer.add_callback(_dcp_callback_class()(trainer))
        _resume_from_dcp(trainer)
    remember(trainer, PREPARED)
    return trainer


def _reference_stays_sharded(trainer: Any, model: nn.Module) -> None:
    """TRL's ``DPOTrainer`` / ``GRPOTrainer`` with ``ref_model=None`` load the reference again from the
    policy's path, without EP: every expert on every rank. Put an EP twin with its weights in its place
    (:func:`epmoe.training.reference.reference_model`), prepared by the accelerator as TRL prepared
    the unsharded one, which the accelerator then forgets so that it is freed."""
    ref = getattr(trainer, "ref_model", None)
    if not isinstance(ref, nn.Module) or any(True for _ in ep_states(ref)) or not find_experts_modules(ref):
        return
    accelerator = trainer.accelerator
    trainer.ref_model = accelerator.prepare_model(reference_model(model, weights_from=ref), evaluation_mode=True)
    accelerator._models[:] = [m for m in accelerator._models if m is not ref]  # see epmoe.training.launchers


def _save_from_every_rank(trainer: Any, fsdp: bool) -> None:
    """Trainer writes from one process only; the EP ranks must all join the experts' gather: through
    ``_save``, which Trainer calls on every process, or, under a release whose ``save_model`` calls it
    on the writing process only (5.6), after ``save_model``."""
    joined: list[bool] = []  # whether this process's save_model reached _save

    def save(output_dir=None, state_dict=None):
        joined.append(True)
        model = _unwrapped(trainer)
        if state_dict is None and has_expert_lora(model):  # a PeftModel: its expert LoRA factors gathered
            state_dict = adapter_state_dict(model)
            return type(trainer)._save(trainer, output_dir, state_dict=state_dict) if trainer.args.should_save else None
        if trainer.args.should_save and state_dict is None and adapter_without_experts(model):
            with own_state_dict():  # peft keeps the adapter's keys of the whole state dict: no expert among them
                return type(trainer)._save(trainer, output_dir, state_dict=state_dict)
        if trainer.args.should_save:
            return type(trainer)._save(trainer, output_dir, state_dict=state_dict)
        if isinstance(getattr(model, "save_pretrained", None), SavePretrained):
            model.save_pretrained(output_dir or trainer.args.output_dir, state_dict=state_dict, is_main_process=False)

    replaced = trainer.__dict__.get("save_model")  # DeepSpeed ZeRO-3's (epmoe.training.deepspeed)

    def save_model(output_dir=None, _internal_call=False):
        joined.clear()
        if replaced is not None:
            replaced(output_dir, _internal_call=_internal_call)
        elif fsdp:  # Trainer's FSDP branch saves this rank's experts only (or, SHARDED_STATE_DICT, nothing)
            without_fsdp_branch(trainer, type(trainer).save_model, trainer, output_dir, _internal_call=_internal_call)
        else:
            type(trainer).save_model(trainer, output_dir, _internal_call=_internal_call)
        if not joined:
            save(output_dir)

    replace(trainer, "_save", save)
    replace(trainer, "save_model", save_model)
    if fsdp:
        # the scheduler and rank 0's moments, not the plugin's files, which hold rank 0's experts
        replace(
            trainer,
            "_save_optimizer_and_scheduler",
            lambda output_dir: without_fsdp_branch(
                trainer, type(trainer)._save_optimizer_and_scheduler, trainer, output_dir
            ),
        )


def _resume_from_dcp(trainer: Any) -> None:
    """``resume_from_checkpoint``: the model and optimizer from the checkpoint's ``epmoe_dcp/``."""

    def load_from_checkpoint(resume_from_checkpoint, model=None):
        model = _unwrapped(trainer)
        state = get_state_dict(model)
        dcp.load(state, checkpoint_id=_dcp_dir(resume_from_checkpoint, must_exist=True))
        set_state_dict(model, state=state)

    def load_optimizer_and_scheduler(checkpoint):
        # Trainer's own would load its optimizer file, which holds rank 0's experts' moments in the
        # shapes of the world size that saved it: the scheduler from its file, the rest from DCP
        if checkpoint is None:
            return
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        model = _unwrapped(trainer)
        state = get_state_dict(model, trainer.optimizer)
        dcp.load(state, checkpoint_id=_dcp_dir(checkpoint, must_exist=True))
        set_state_dict(model, trainer.optimizer, state=state)

    replace(trainer, "_load_from_checkpoint", load_from_checkpoint)
    replace(trainer, "_load_optimizer_and_scheduler", load_optimizer_and_scheduler)


@functools.cache
def _dcp_callback_class() -> type:
    """:class:`DcpCheckpoint`, built on first use (transformers is an optional dependency)."""
    from transformers import TrainerCallback

    class DcpCheckpoint(TrainerCallback):
        """Adds ``epmoe_dcp/`` (model and optimizer through :func:`epmoe.get_state_dict` and
        ``torch.distributed.checkpoint``, every rank) to each checkpoint the Trainer has just written."""

        def __init__(self, trainer: Any):
            self.trainer = trainer

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args.save_only_model:  # Trainer saves no optimizer either: such a checkpoint does not resume
                return
            checkpoint = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
            if not os.path.isdir(checkpoint):
                raise ValueError(
                    f"prepare_trainer: the Trainer's checkpoint {checkpoint} is not where it is expected "
                    f"(a hyperparameter search writes elsewhere): its epmoe_dcp/ cannot be written"
                )
            dcp.save(
                get_state_dict(_unwrapped(self.trainer), self.trainer.optimizer), checkpoint_id=_dcp_dir(checkpoint)
            )

    DcpCheckpoint.__module__ = __name__
    return DcpCheckpoint


def _unwrapped(trainer: Any) -> nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)


def _dcp_dir(checkpoint: str, must_exist: bool = False) -> str:
    """Where a Trainer checkpoint keeps the EP model and optimizer for ``torch.distributed.checkpoint``."""
    path = os.path.join(checkpoint, DCP_DIR)
    if must_exist and not os.path.isdir(path):
        raise ValueError(
            f"prepare_trainer: {checkpoint} has no {DCP_DIR}/: it was not written by a prepared Trainer, and its "
            f"optimizer file holds only rank 0's experts' moments; resume from a checkpoint a prepared Trainer wrote"
        )
    return path
