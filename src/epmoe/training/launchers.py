"""The launcher table: what epmoe does to other libraries' objects, in one place.

:func:`epmoe.prepare_trainer`, :func:`epmoe.prepare_accelerator` and :func:`epmoe.prepare_deepspeed`
use the libraries' public hooks where they have one: a ``TrainerCallback`` (the DCP half of a Trainer
checkpoint), accelerate's FSDP2 plugin (``ignored_modules``), DeepSpeed's MoE protocol (parameter
marks, ``'moe'`` param groups, a DeepSpeed MoE layer child). Where none exists, a method is
replaced *on the instance* (the class is untouched). :data:`TABLE` lists every such method, each
DeepSpeed method epmoe overrides, each private function of another library epmoe calls and the
attributes of a DeepSpeed engine it reads, each with its signature as checked against
:data:`CHECKED_AGAINST` and why; tests/training/test_launchers.py fails when one disappears or changes
signature (on TRL's ``SFTTrainer`` too, which inherits the Trainer methods). Besides methods, epmoe
writes accelerate's FSDP plugin's ``ignored_modules`` (its configuration, :mod:`epmoe.training.fsdp`)
and, for the duration of one call, a Trainer's ``is_fsdp_enabled`` (``without_fsdp_branch`` there) or
``is_deepspeed_enabled`` (``without_deepspeed_branch`` in :mod:`epmoe.training.deepspeed`); where
:func:`epmoe.prepare_trainer` puts an EP reference model in place of an unsharded one, it removes the
unsharded one from the list of models the accelerator prepared (``Accelerator._models``; checked by
tests/training/test_reference.py), or that list would keep it alive.

What epmoe remembers about other libraries' objects (a Trainer or accelerator prepared, a Trainer
whose optimizer gets split groups, a router with a load balancer) sits in one registry keyed by the
object (:func:`remember`, :func:`remembered`), not in attributes on it.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epmoe.training.clip import clip_grad_norm_

CHECKED_AGAINST = {"transformers": "5.24.0", "accelerate": "1.16.0", "deepspeed": "0.19.8", "trl": "1.16.0"}

GRPO_SINCE = "1.16.0"  # GRPOTrainer._generate_single_turn takes num_generations from trl 1.16 on

REPLACED = "replaced on the instance"
OVERRIDDEN = "overridden in a subclass"
CALLED = "called"
READ = "an attribute it has set read while it calls epmoe"


@dataclass(frozen=True)
class Entry:
    """One method of another library that epmoe replaces, overrides, calls or relies on.

    ``owner``: the dotted path of its class or module; ``signature``: its parameters (names, kinds,
    defaults; no annotations) as checked against :data:`CHECKED_AGAINST`; ``since``: the first release
    of ``library`` epmoe adapts it in, where older releases lack it or differ (there epmoe leaves it
    alone where what it adapts goes through another method of the table, or refuses naming the
    release)."""

    library: str
    owner: str
    method: str
    signature: str
    how: str
    why: str
    since: str = ""

    def resolve(self) -> Callable:
        """The method itself in the installed library (``ImportError`` / ``AttributeError`` when gone)."""
        module_name, _, attr = self.owner.rpartition(".")
        try:
            owner = importlib.import_module(self.owner)
        except ImportError:
            owner = getattr(importlib.import_module(module_name), attr)
        return getattr(owner, self.method)


TABLE = (
    Entry(
        "accelerate",
        "accelerate.Accelerator",
        "clip_grad_norm_",
        "(self, parameters, max_norm, norm_type=2)",
        REPLACED,
        "torch's norm sees this rank's experts only: epmoe.clip_grad_norm_ after unscale_gradients",
    ),
    Entry(
        "accelerate",
        "accelerate.Accelerator",
        "unscale_gradients",
        "(self, optimizer=None)",
        CALLED,
        "what accelerate's own clip_grad_norm_ does first",
    ),
    Entry(
        "accelerate",
        "accelerate.Accelerator",
        "prepare",
        "(self, *args, device_placement=None)",
        REPLACED,
        "DeepSpeed plugin: prepare_deepspeed on the EP models, the optimizers' MoE groups split, "
        "before accelerate calls deepspeed.initialize",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "create_optimizer",
        "(self, model=None)",
        REPLACED,
        "FSDP2: the optimizer Trainer builds gets the experts in param groups apart from DTensors",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "_mixed_mesh_grad_norm",
        "(self, model, max_norm)",
        REPLACED,
        "FSDP2 with plain expert tensors: Trainer clips here, not through the accelerator",
        since="5.17.0",  # before, Trainer clips through accelerator.clip_grad_norm_ only
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "_save",
        "(self, output_dir=None, state_dict=None)",
        REPLACED,
        "the experts are gathered from every rank: the non-writing ranks join save_pretrained",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "save_model",
        "(self, output_dir=None, _internal_call=False)",
        REPLACED,
        "every process joins the save (transformers 5.6 calls _save from the writing process only); FSDP2: "
        "Trainer's FSDP branch would save this rank's experts only; DeepSpeed ZeRO-3: its branch would gather "
        "rank 0's experts only",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "_save_optimizer_and_scheduler",
        "(self, output_dir)",
        REPLACED,
        "FSDP2: the plugin's optimizer files hold rank 0's experts only",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "_load_from_checkpoint",
        "(self, resume_from_checkpoint, model=None)",
        REPLACED,
        "the checkpoint's model file holds all experts: the model is resumed from epmoe_dcp/",
    ),
    Entry(
        "transformers",
        "transformers.Trainer",
        "_load_optimizer_and_scheduler",
        "(self, checkpoint)",
        REPLACED,
        "the optimizer file holds rank 0's moments: the optimizer is resumed from epmoe_dcp/",
    ),
    Entry(
        "trl",
        "trl.GRPOTrainer",
        "_generate_single_turn",
        "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
        REPLACED,
        "replay_rollout_routing: the rollout's generate runs under record_routing",
        since=GRPO_SINCE,
    ),
    Entry(
        "trl",
        "trl.GRPOTrainer",
        "_generate_and_score_completions",
        "(self, inputs)",
        REPLACED,
        "replay_rollout_routing: the rollout's routes become a per-sample field of the batch",
        since=GRPO_SINCE,
    ),
    Entry(
        "trl",
        "trl.GRPOTrainer",
        "training_step",
        "(self, model, inputs, num_items_in_batch)",
        REPLACED,
        "replay_rollout_routing: the replay stays open through the backward (recomputation)",
        since=GRPO_SINCE,
    ),
    Entry(
        "trl",
        "trl.GRPOTrainer",
        "_compute_loss",
        "(self, model, inputs)",
        REPLACED,
        "replay_rollout_routing: the micro-batch's routes are replayed from its forward on",
        since=GRPO_SINCE,
    ),
    Entry(
        "deepspeed",
        "deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer",
        "set_deepspeed_parallelism",
        "(self, use_data_before_expert_parallel_=False, folding_group_handles=None)",
        OVERRIDDEN,
        "the engine calls it on a model's MoE layers (AutoEP's: accepted under ZeRO-3 too): epmoe's "
        "expert groups become DeepSpeed's",
    ),
    Entry(
        "deepspeed",
        "deepspeed.utils.groups",
        "_create_expert_and_data_parallel",
        "(expert_parallel_size_, mp_size=None, pp_size=None, mp_mode='tp', use_data_before_expert_parallel_=False, "
        "folding_spec=None)",
        CALLED,
        "what DeepSpeed's own MoE layers call to create the expert groups",
    ),
    Entry(
        "deepspeed",
        "deepspeed.utils.groups",
        "_get_expert_parallel_group_dict",
        "()",
        CALLED,
        "whether the groups of an EP size exist",
    ),
    Entry(
        "deepspeed",
        "deepspeed.utils.groups",
        "_get_expert_parallel_group",
        "(group_name)",
        CALLED,
        "checked against epmoe's EP group",
    ),
    Entry(
        "deepspeed",
        "deepspeed.utils.groups",
        "_get_expert_data_parallel_group",
        "(group_name)",
        CALLED,
        "checked against epmoe's 'dp' replicas",
    ),
    Entry(
        "deepspeed",
        "deepspeed.runtime.engine.DeepSpeedEngine",
        "_configure_distributed_model",
        "(self, model)",
        READ,
        "calls set_deepspeed_parallelism with engine.client_optimizer and engine._config set: the "
        "optimizer's param groups and the ZeRO config (stage 3 offload) are checked there, before "
        "DeepSpeed's own assertion about unmarked groups and before anything is partitioned",
    ),
)

_ALSO_ON = {"transformers.Trainer": ("trl.SFTTrainer",)}  # subclasses users prepare, whose methods must match


def signature_text(fn: Callable) -> str:
    """``fn``'s parameters as :data:`TABLE` records them: names, kinds and defaults, no annotations."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]
    return str(inspect.Signature(params))


def differs(entry: Entry) -> bool:
    """Whether the installed library lacks ``entry``'s method or has it with another signature (a
    library that fails to import, as trl 0.24 beside transformers 5.6 does, lacks it)."""
    try:
        return signature_text(entry.resolve()) != entry.signature
    except (ImportError, AttributeError, RuntimeError):
        return True


def entries_to_check() -> list[tuple[Entry, str]]:
    """``(entry, owner)`` for every entry and every subclass in ``_ALSO_ON`` it must hold on."""
    return [(entry, owner) for entry in TABLE for owner in (entry.owner, *_ALSO_ON.get(entry.owner, ()))]


def _entry(obj: Any, name: str, table: tuple[Entry, ...]) -> Entry:
    for entry in table:
        if entry.method == name and entry.how == REPLACED and is_instance_of(obj, entry.owner):
            return entry
    raise LookupError(f"epmoe: {type(obj).__name__}.{name} is not in the launcher table (epmoe.training.launchers)")


def is_instance_of(obj: Any, owner: str) -> bool:
    """Whether ``obj`` is an instance of the class at the dotted path ``owner`` (``False`` where it is not installed)."""
    module_name, _, class_name = owner.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and isinstance(obj, cls)


def replace(obj: Any, name: str, method: Callable, table: tuple[Entry, ...] = TABLE) -> None:
    """Make ``method`` ``obj.name`` (an instance attribute; the class is untouched). ``obj.name`` must be
    listed in ``table`` (:data:`TABLE`, or another library's own, such as twinkle's) as replaced."""
    _entry(obj, name, table)
    setattr(obj, name, method)


_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(obj: Any, what: str) -> None:
    """Note that epmoe did ``what`` to ``obj`` (another library's object); forgotten with the object."""
    _REGISTRY.setdefault(obj, set()).add(what)


def remembered(obj: Any, what: str) -> bool:
    """Whether :func:`remember` noted ``what`` for ``obj`` (this very object, not a copy)."""
    return what in _REGISTRY.get(obj, ())


def accelerator_clip(accelerator: Any) -> Callable:
    """What replaces ``accelerator.clip_grad_norm_`` (and a Trainer's ``_mixed_mesh_grad_norm``):
    accelerate's ``unscale_gradients``, then :func:`epmoe.clip_grad_norm_` (the same norm on every rank)."""

    def clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        accelerator.unscale_gradients()  # what accelerate's own clip_grad_norm_ does first
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    return clip
