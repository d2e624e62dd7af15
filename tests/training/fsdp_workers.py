"""Rank functions for tests/training/test_fsdp.py: transformers' Trainer under accelerate's FSDP2 plugin,
configured the HF way (``TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, ...})``).

accelerate honours the FSDP plugin only when its ``PartialState`` reports a multi-accelerator
distributed type (``AcceleratorState.__init__`` turns ``MULTI_GPU`` & co. into ``FSDP``); on this CPU
machine it reports ``MULTI_CPU`` and a Trainer given the FSDP config would silently run plain DDP.
:func:`as_on_gpus` makes accelerate decide as it would on a GPU machine, in this rank process only,
while a Trainer builds its ``Accelerator``: the model stays on the CPU and ``fully_shard`` (given no
mesh by accelerate) builds its default mesh, a CPU one over the gloo group.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from training_workers import TokenDataset, rel, run_checks, trainer_log, trainer_log_errors

import epmoe
from epmoe.models import build_model

FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3MoeDecoderLayer"]}
MAX_GRAD_NORM = 0.5


@contextlib.contextmanager
def as_on_gpus():
    """accelerate's distributed type as a multi-GPU launch sets it, while the block builds a Trainer.

    Only ``PartialState``'s shared ``distributed_type`` changes, and only inside the block: the
    ``AcceleratorState`` the Trainer's ``Accelerator`` creates copies it and, given the FSDP plugin,
    becomes ``DistributedType.FSDP``; ``PartialState`` is restored to ``MULTI_CPU`` afterwards. The
    ``AcceleratorState`` a previous Trainer of this process left (accelerate shares it process-wide,
    plugin included) is reset first, as a fresh process would have none.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    assert shared, "build the TrainingArguments first: they initialise accelerate's PartialState (use_cpu=True)"
    AcceleratorState._reset_state()
    before = shared["distributed_type"]
    assert before == DistributedType.MULTI_CPU, before
    shared["distributed_type"] = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        shared["distributed_type"] = before


def args(out_dir, tag, steps, **kw):
    from transformers import TrainingArguments

    options = dict(
        output_dir=f"{out_dir}/{tag}",
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        fsdp="full_shard auto_wrap",
        fsdp_config=dict(FSDP_CONFIG),
    )
    options.update(kw)
    return TrainingArguments(**options)


def full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def trainer_parity(rank, world, out_dir, steps=4):
    """The EP model through prepare_trainer vs the unsharded model through a plain Trainer, both with
    the same HF FSDP2 config (AdamW, max_grad_norm 0.5: it clips at every step, accumulation 2):
    every parameter after ``steps`` steps, the logged grad norms and losses, the eval loss; then
    ``save_model`` and a plain ``from_pretrained`` reload compared with the reference's weights."""
    from transformers import AutoModelForCausalLM, Trainer

    train, evaluation = TokenDataset(64, 12, seed=1), TokenDataset(6, 12, seed=2)
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    args_ref, args_ep = args(out_dir, "ref", steps), args(out_dir, "ep", steps)
    with as_on_gpus():
        trainer_ref = Trainer(model=ref, args=args_ref, train_dataset=train, eval_dataset=evaluation)
    assert trainer_ref.is_fsdp_enabled and str(trainer_ref.accelerator.distributed_type).endswith("FSDP")
    trainer_ref.train()
    eval_ref = trainer_ref.evaluate()["eval_loss"]
    log_ref = trainer_ref.state.log_history
    ref_full = {name: full(p).clone() for name, p in trainer_ref.model.named_parameters()}
    dist.barrier()
    with as_on_gpus():
        trainer = epmoe.prepare_trainer(
            Trainer(model=model, args=args_ep, train_dataset=train, eval_dataset=evaluation)
        )
    assert epmoe.prepare_trainer(trainer) is trainer  # idempotent
    distributed = str(trainer.accelerator.distributed_type)
    trainer.train()
    eval_ep = trainer.evaluate()["eval_loss"]

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in trainer.model.modules():  # evaluate's forward left the tail (reshard_after_forward=False) unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    rows = {s.module_name: slice(s.local_start, s.local_end) for s in shards}
    errors, kinds = {}, {}
    for name, p in trainer.model.named_parameters():
        expert = epmoe.is_expert_parameter(p)
        kind = f"{'expert' if expert else 'other'}/{'dtensor' if isinstance(p, DTensor) else 'plain'}"
        kinds[kind] = kinds.get(kind, 0) + 1
        want = ref_full[name][rows[name.rsplit(".", 1)[0]]] if expert else ref_full[name]
        errors[f"param/{name}"] = rel(full(p), want)
    log = trainer.state.log_history
    norms, norms_ref = trainer_log(log, "grad_norm"), trainer_log(log_ref, "grad_norm")
    assert len(norms) == len(norms_ref) == steps, (norms, norms_ref)
    assert len(trainer_log(log, "loss")) == len(trainer_log(log_ref, "loss")) == steps, (log, log_ref)
    errors.update(trainer_log_errors(log, log_ref, eval_ep, eval_ref))

    # Trainer.save_model: every rank joins; plain transformers reloads the whole (unsharded) model
    trainer.save_model(f"{out_dir}/saved")
    loaded = AutoModelForCausalLM.from_pretrained(f"{out_dir}/saved", dtype=torch.float64)
    loaded_params = dict(loaded.named_parameters())
    assert set(loaded_params) == set(ref_full), set(loaded_params) ^ set(ref_full)
    for name, p in loaded_params.items():
        errors[f"saved/{name}"] = rel(p, ref_full[name])
    return {
        "errors": errors,
        "norms": norms,
        "distributed": distributed,
        "kinds": kinds,
        "files": sorted(os.listdir(f"{out_dir}/saved")),
    }


def trainer_resume(rank, world, out_dir, steps=4):
    """A prepared Trainer under the HF FSDP2 config checkpointing every 2 steps trains 4 steps; a fresh
    one (other initial weights) resumes from checkpoint-2 and trains to 4: every parameter (fp64) and
    the logged losses of steps 3-4 equal the uninterrupted run's."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer

    def run(seed, resume=None):
        model = build_model("qwen3_moe", dtype=torch.float64, seed=seed)
        epmoe.apply_expert_parallel(model)
        training_args = args(out_dir, "run", steps, gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)
        with as_on_gpus():
            trainer = epmoe.prepare_trainer(
                Trainer(model=model, args=training_args, train_dataset=TokenDataset(64, 12, seed=1))
            )
        trainer.train(resume_from_checkpoint=resume)
        for module in trainer.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        params = {name: full(p).clone() for name, p in trainer.model.named_parameters()}
        return params, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    params, losses = run(0)
    dist.barrier()
    resumed, losses2 = run(99, resume=f"{out_dir}/run/checkpoint-2")
    assert set(resumed) == set(params) and params
    errors = {f"param/{name}": rel(resumed[name], params[name]) for name in params}
    errors.update({f"loss/{step}": abs(losses2[step] - losses[step]) / abs(losses[step]) for step in (3, 4)})
    return {"errors": errors, "files": sorted(os.listdir(f"{out_dir}/run/checkpoint-2"))}


def refused(rank, world, out_dir, case):
    """prepare_trainer on an EP Trainer whose FSDP config cannot be made exact: its ValueError."""
    from transformers import Trainer

    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    config = dict(FSDP_CONFIG)
    env = {}
    if case == "fsdp1":  # sync_module_states (transformers' FSDP1 default) needs an accelerator to build the plugin
        config.update(version=1, sync_module_states=False)
    elif case == "cpu_ram_efficient_loading":
        config["cpu_ram_efficient_loading"] = True
    elif case == "ignored_modules_wrong":  # accelerate's env setting, naming the attention instead
        env["FSDP_IGNORED_MODULES"] = r"model\.layers\.\d+\.self_attn"
    saved = {k: os.environ.get(k) for k in (*env, "FSDP_CPU_RAM_EFFICIENT_LOADING")}
    os.environ.update(env)
    try:
        training_args = args(out_dir, case, 2, fsdp_config=config)
        with as_on_gpus():
            trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(8, 12, seed=1))
        try:
            epmoe.prepare_trainer(trainer)
        except ValueError as exc:
            return {"error": str(exc), "fsdp": trainer.is_fsdp_enabled}
        return {"error": None, "fsdp": trainer.is_fsdp_enabled}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def two_rank_checks(rank, world, out_dir):
    checks = {
        "parity": lambda: trainer_parity(rank, world, f"{out_dir}/parity"),
        "resume": lambda: trainer_resume(rank, world, f"{out_dir}/resume"),
    }
    for case in ("fsdp1", "cpu_ram_efficient_loading", "ignored_modules_wrong"):
        checks[case] = lambda case=case: refused(rank, world, out_dir, case)
    return run_checks(checks)
