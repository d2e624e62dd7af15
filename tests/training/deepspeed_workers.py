"""Rank functions for the DeepSpeed tests (module level for spawned ranks): every case trains the same
recipe twice, with EP (``prepare_deepspeed`` / ``prepare_trainer``) and without (every rank holding all
experts, DeepSpeed's plain data parallelism), and returns the relative differences per quantity. ZeRO
stage 3 runs in float32 (DeepSpeed partitions float32, bfloat16 or float16 parameters only), every
parameter partitioned (``stage3_param_persistence_threshold`` 0), and compares gathered parameters."""

import contextlib
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import epmoe  # noqa: E402
from epmoe.ep.state import ep_states  # noqa: E402
from epmoe.models import build_model  # noqa: E402

STEPS = 3
CLIP = 0.05  # small enough that every step clips (the norms are ~0.5-2)


def ds_config(stage, *, optimizer="AdamW", clip=CLIP, auto=False, offload=None):
    config = {
        "train_micro_batch_size_per_gpu": "auto" if auto else 2,
        "gradient_accumulation_steps": "auto" if auto else 1,
        "gradient_clipping": "auto" if auto else clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:  # every parameter partitioned, however small; Trainer's save_model of the plain run gathers
        config["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True
        )
    if offload is not None:  # ("offload_param" or "offload_optimizer", "cpu" or "nvme")
        option, device = offload
        config["zero_optimization"][option] = {"device": device, **({"nvme_path": "/tmp"} if device == "nvme" else {})}
    if optimizer == "AdamW":
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto" if auto else 1e-2, "weight_decay": "auto" if auto else 0.01, "torch_adam": True},
        }
    elif optimizer == "SGD":  # no normalisation: a mis-scaled expert gradient would move the weights by its factor
        config["optimizer"] = {"type": "SGD", "params": {"lr": "auto" if auto else 0.5}}
        config["zero_allow_untested_optimizer"] = True
    return config


def batch_of(rank, step, batch=2, length=12, vocab=64):
    g = torch.Generator().manual_seed(1000 + 17 * rank + step)
    return torch.randint(0, vocab, (batch, length), generator=g)


def dtype_of(stage):
    return torch.float32 if stage == 3 else torch.float64


_MESH = []  # this process's ("dp", "ep") mesh, made once


def dp_ep_mesh():
    """A ("dp", "ep") mesh of EP 2 over the world (4 ranks: EP 2 x DP 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESH:
        world = torch.distributed.get_world_size()
        _MESH.append(init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep")))
    return _MESH[0]


def fresh_model(ep, dtype=torch.float64, mesh=False):
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=dtype)
    if ep:
        epmoe.apply_expert_parallel(model, dp_ep_mesh() if mesh else None)
    return model


def gathered(*models):
    """ZeRO-3's partitioned parameters of ``models`` gathered whole for the block (nothing elsewhere)."""
    import deepspeed

    stack = contextlib.ExitStack()
    for model in models:
        stack.enter_context(deepspeed.zero.GatheredParameters(list(model.parameters())))
    return stack


def expert_slices(model):
    """``{parameter name: (start, end)}`` of this rank's experts, for the sharded parameters."""
    out = {}
    for module_name, _module, state in ep_states(model):
        for name in state.sharded_names:
            out[f"{module_name}.{name}"] = (state.shard.local_start, state.shard.local_end)
    return out


def max_rel(a, b):
    scale = b.abs().max().clamp_min(1e-12)
    return ((a - b).abs().max() / scale).item()


def compare_params(ep_model, ref_model):
    """The largest relative difference over every parameter (experts: the reference's slice for this
    rank), and how many parameters / expert parameters were compared."""
    slices = expert_slices(ep_model)
    ref = dict(ref_model.named_parameters())
    worst, count, experts = 0.0, 0, 0
    with gathered(ep_model, ref_model):  # ZeRO-3: the experts over their "dp" replicas, the rest over all ranks
        for name, p in ep_model.named_parameters():
            target = ref[name].detach()
            if name in slices:
                start, end = slices[name]
                target = target[start:end]
                experts += 1
            assert p.shape == target.shape, name
            worst = max(worst, max_rel(p.detach(), target))
            count += 1
    return worst, count, experts


def train_engine(model, config, rank):
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch_of(rank, step)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().double())
        norms.append(torch.as_tensor(float(engine.get_global_grad_norm()), dtype=torch.float64))
    return torch.stack(losses), torch.stack(norms), engine


def initialize_case(rank, stage, optimizer):
    """deepspeed.initialize with ZeRO ``stage``: EP (prepare_deepspeed) vs the same recipe without EP."""
    ref_losses, ref_norms, ref_engine = train_engine(fresh_model(ep=False), ds_config(stage, optimizer=optimizer), rank)
    model = epmoe.prepare_deepspeed(fresh_model(ep=True))
    losses, norms, engine = train_engine(model, ds_config(stage, optimizer=optimizer), rank)
    params, count, experts = compare_params(engine.module, ref_engine.module)
    return {
        "loss": max_rel(losses, ref_losses),
        "grad_norm": max_rel(norms, ref_norms),
        "params": params,
        "compared": count,
        "expert_params": experts,
        "steps": len(losses),
        "weights_dtype": str(next(engine.module.parameters()).dtype),
    }


def trainer_run(ep, stage, ds_optimizer, output_dir, mesh=False):
    """One Trainer run (DeepSpeed ZeRO ``stage``); ``ds_optimizer``: the optimizer named in the DeepSpeed
    config ("AdamW", "SGD") or ``None`` (Trainer builds its AdamW): ``(trainer, its loss logs)``."""
    from transformers import Trainer, TrainingArguments

    model = fresh_model(ep, dtype_of(stage), mesh)
    rows = torch.randint(0, 64, (24, 12), generator=torch.Generator().manual_seed(5))
    dataset = [{"input_ids": ids, "labels": ids} for ids in rows]
    config = ds_config(stage, optimizer=ds_optimizer, auto=True)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_grad_norm=CLIP,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        deepspeed=config,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    if ep:
        epmoe.prepare_trainer(trainer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    if ep or stage < 3:  # transformers' own ZeRO-3 save_model fails on the non-writing ranks
        trainer.save_model(output_dir)
    return trainer, logs


def trainer_case(rank, stage, ds_optimizer, tmp, mesh=False):
    """Trainer(TrainingArguments(deepspeed=...)) + prepare_trainer vs the same Trainer without EP; also
    trainer.save_model: the EP checkpoint's tensors vs the plain one's (all E experts)."""
    ref, ref_logs = trainer_run(False, stage, ds_optimizer, f"{tmp}/ref-{stage}")
    ep, logs = trainer_run(True, stage, ds_optimizer, f"{tmp}/ep-{stage}", mesh)
    assert len(logs) == len(ref_logs) == STEPS, (logs, ref_logs)
    out = {"params": 0.0, "compared": 0, "expert_params": 0}
    for key in ("loss", "grad_norm"):
        out[key] = max_rel(torch.tensor([e[key] for e in logs]), torch.tensor([e[key] for e in ref_logs]))
    out["params"], out["compared"], out["expert_params"] = compare_params(ep.model, ref.model)
    torch.distributed.barrier()
    if stage == 3:  # the EP run's save_model reloaded by plain transformers vs the plain run's parameters
        out.update(reloaded(f"{tmp}/ep-{stage}", ref.model, rank))
    elif rank == 0:
        from safetensors.torch import load_file

        saved, ref_saved = (load_file(f"{tmp}/{kind}-{stage}/model.safetensors") for kind in ("ep", "ref"))
        assert sorted(saved) == sorted(ref_saved), (sorted(saved), sorted(ref_saved))
        out["saved"] = max(max_rel(saved[k].double(), ref_saved[k].double()) for k in saved)
        out["saved_compared"] = len(saved)
    return out


def accelerate_run(ep, stage, ds_optimizer, rank):
    """An accelerate loop under its DeepSpeed plugin (ZeRO ``stage``; the optimizer in the DeepSpeed
    config through ``DummyOptim``, or torch's AdamW): ``(losses, norms, engine)``; ``ep``: the EP model
    through ``epmoe.prepare_accelerator``."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DummyOptim

    AcceleratorState._reset_state(True)  # a fresh plugin for each run of this process
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage, optimizer="AdamW" if ds_optimizer else None))
    )
    model = fresh_model(ep, dtype_of(stage))
    if ep:
        assert epmoe.prepare_accelerator(accelerator) is accelerator
    optimizer = (
        DummyOptim(model.parameters())
        if ds_optimizer
        else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    )
    engine, optimizer = accelerator.prepare(model, optimizer)
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch_of(rank, step)
        loss = engine(ids, labels=ids).loss
        accelerator.backward(loss)  # DeepSpeed's backward and step (it clips: gradient_clipping)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().double())
        norms.append(
            torch.as_tensor(float(accelerator.clip_grad_norm_(engine.parameters(), CLIP)), dtype=torch.float64)
        )
    return torch.stack(losses), torch.stack(norms), engine


def accelerate_case(rank, stage, ds_optimizer):
    """prepare_accelerator under accelerate's DeepSpeed plugin vs the same loop without EP."""
    ref_losses, ref_norms, ref_engine = accelerate_run(False, stage, ds_optimizer, rank)
    losses, norms, engine = accelerate_run(True, stage, ds_optimizer, rank)
    params, count, experts = compare_params(engine.module, ref_engine.module)
    moe_groups = sum(bool(group.get("moe")) for group in engine.optimizer.optimizer.param_groups) if stage < 3 else None
    return {
        "loss": max_rel(losses, ref_losses),
        "grad_norm": max_rel(norms, ref_norms),
        "params": params,
        "compared": count,
        "expert_params": experts,
        "steps": len(losses),
        "moe_groups": moe_groups,
    }


def accelerate_refused(stage, prepare_first, offload=None):
    """prepare_accelerator where it cannot be exact under accelerate's DeepSpeed plugin: ZeRO 3 with
    ``offload`` to NVMe, or an engine that accelerator.prepare has already built for the EP model
    (``prepare_first``): its error."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DummyOptim

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage, offload=offload)))
    if prepare_first:
        model = fresh_model(ep=True)
        accelerator.prepare(model, DummyOptim(model.parameters()))
    try:
        epmoe.prepare_accelerator(accelerator)
    except ValueError as error:
        return str(error)
    return "no error"


def unsplit_optimizer_initialize(rank):
    """prepare_deepspeed, then deepspeed.initialize with a torch optimizer whose param groups were not
    split into DeepSpeed's MoE groups: the error the user sees."""
    import deepspeed

    model = epmoe.prepare_deepspeed(fresh_model(ep=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(2, optimizer=None))
    except (ValueError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def unprepared_initialize(rank):
    """deepspeed.initialize on an EP model without prepare_deepspeed: refused at the first forward."""
    import deepspeed

    model = fresh_model(ep=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config(2))
    ids = batch_of(rank, 0)
    try:
        engine(ids, labels=ids)
    except ValueError as error:
        return str(error)
    return "no error"


def unprepared_trainer(tmp):
    from transformers import Trainer, TrainingArguments

    model = fresh_model(ep=True)
    dataset = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12))]
    args = TrainingArguments(
        output_dir=f"{tmp}/unprepared",
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        deepspeed=ds_config(2, auto=True),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    try:
        trainer.train()
    except ValueError as error:
        return str(error), trainer.state.global_step
    return "no error", trainer.state.global_step


def zero3_initialize_case(rank, tmp, mesh=False, offload=None):
    """deepspeed.initialize under ZeRO-3 (SGD; ``offload``: see :func:`ds_config`): EP (prepare_deepspeed)
    vs the same recipe without EP, the parameters gathered; then the EP model's save_pretrained (every
    rank), reloaded by plain transformers on rank 0 and compared with the plain run's gathered
    parameters; where DeepSpeed put the experts."""
    world = torch.distributed.get_world_size()
    config = ds_config(3, optimizer="SGD", offload=offload)
    ref_losses, ref_norms, ref_engine = train_engine(fresh_model(False, torch.float32), config, rank)
    model = epmoe.prepare_deepspeed(fresh_model(True, torch.float32, mesh))
    losses, norms, engine = train_engine(model, config, rank)
    params, count, experts = compare_params(engine.module, ref_engine.module)
    expert = next(iter(epmoe.expert_parameters(engine.module)))
    other = engine.module.get_input_embeddings().weight
    out = {
        "loss": max_rel(losses, ref_losses),
        "grad_norm": max_rel(norms, ref_norms),
        "params": params,
        "compared": count,
        "expert_params": experts,
        "steps": len(losses),
        "marker": type(engine.module.epmoe_deepspeed).__mro__[1].__name__,
        "expert_partition": [
            torch.distributed.get_world_size(expert.ds_process_group),
            expert.ds_tensor.numel(),
            expert.ds_numel,
            expert.numel(),
        ],
        "other_partition": [
            torch.distributed.get_world_size(other.ds_process_group),
            other.ds_tensor.numel(),
            other.ds_numel,
        ],
    }
    path = f"{tmp}/z3-save-{world}-{offload and offload[0]}"
    engine.module.save_pretrained(path)
    out.update(reloaded(path, ref_engine.module, rank))
    return out


def reloaded(path, ref_module, rank):
    """On rank 0: the checkpoint at ``path`` reloaded by plain transformers vs ``ref_module``'s parameters
    (gathered under ZeRO-3) as ``{"reloaded": largest relative difference, "reloaded_compared": count}``."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(ref_module.parameters())):
        ref = {name: p.detach().clone() for name, p in ref_module.named_parameters()}
    out = {}
    if rank == 0:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # plain transformers: not a ZeRO-3 load
        loaded = dict(type(ref_module).from_pretrained(path, dtype=torch.float32).named_parameters())
        assert sorted(loaded) == sorted(ref), (sorted(loaded), sorted(ref))
        out["reloaded"] = max(max_rel(loaded[name].detach(), ref[name]) for name in ref)
        out["reloaded_compared"] = len(loaded)
    torch.distributed.barrier()
    return out


def zero3_refused_initialize(rank, prepare, offload):
    """deepspeed.initialize under ZeRO-3 where it cannot be exact: ``offload`` to NVMe (after
    prepare_deepspeed), or the EP model not prepared (refused at the first forward): the error and the
    number of steps taken."""
    import deepspeed

    model = fresh_model(ep=True, dtype=torch.float32)
    if prepare:
        epmoe.prepare_deepspeed(model)
    steps = 0
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=list(model.parameters()), config=ds_config(3, offload=offload)
        )
        ids = batch_of(rank, 0)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
        steps += 1
    except ValueError as error:
        return str(error), steps
    return "no error", steps


def zero3_lora_initialize(rank, experts):
    """deepspeed.initialize under ZeRO-3 of a PeftModel around the EP model (LoRA on its experts, or on
    attention only): the error."""
    import deepspeed
    from peft import LoraConfig, get_peft_model

    lora = (
        LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
        if experts
        else LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    )
    model = epmoe.prepare_deepspeed(get_peft_model(fresh_model(ep=True, dtype=torch.float32), lora))
    try:
        deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config(3)
        )
    except ValueError as error:
        return str(error)
    return "no error"


def zero3_offload_trainer(tmp, offload):
    """prepare_trainer under ZeRO-3 with ``offload`` (to NVMe): its error."""
    from transformers import Trainer, TrainingArguments

    model = fresh_model(ep=True, dtype=torch.float32)
    args = TrainingArguments(
        output_dir=f"{tmp}/z3-{offload[0]}",
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        deepspeed=ds_config(3, auto=True, offload=offload),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}])
    try:
        epmoe.prepare_trainer(trainer)
    except ValueError as error:
        return str(error), trainer.state.global_step
    return "no error", trainer.state.global_step


def _guard(fn, *args):
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - one failing case must not hide the others' results
        import traceback

        return {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"}


def run_all(rank, world, tmp):
    """Every DeepSpeed case in one spawn: ``{case: result}``; a case that raised gives its error."""
    results = {
        "initialize_zero1_sgd": _guard(initialize_case, rank, 1, "SGD"),
        "initialize_zero2_adamw": _guard(initialize_case, rank, 2, "AdamW"),
        "trainer_zero2_ds_optimizer": _guard(trainer_case, rank, 2, "AdamW", tmp),
        "trainer_zero1_trainer_optimizer": _guard(trainer_case, rank, 1, None, tmp),
        "accelerate_zero2_ds_optimizer": _guard(accelerate_case, rank, 2, True),
        "accelerate_zero1_torch_optimizer": _guard(accelerate_case, rank, 1, False),
        "unsplit_optimizer_initialize": _guard(unsplit_optimizer_initialize, rank),
        "accelerate_after_prepare": _guard(accelerate_refused, 2, True),
        "unprepared_initialize": _guard(unprepared_initialize, rank),
        "unprepared_trainer": _guard(unprepared_trainer, tmp),
        # stage 3 last (a Trainer or accelerator under it turns on transformers' zero3 mode), initialize first
        "zero3_initialize_sgd": _guard(zero3_initialize_case, rank, tmp),
        "zero3_unprepared_initialize": _guard(zero3_refused_initialize, rank, False, None),
        "zero3_offload_param_initialize": _guard(zero3_initialize_case, rank, tmp, False, ("offload_param", "cpu")),
        "zero3_offload_optimizer_initialize": _guard(
            zero3_initialize_case, rank, tmp, False, ("offload_optimizer", "cpu")
        ),
        "zero3_nvme_param_initialize": _guard(zero3_refused_initialize, rank, True, ("offload_param", "nvme")),
        "zero3_nvme_optimizer_initialize": _guard(zero3_refused_initialize, rank, True, ("offload_optimizer", "nvme")),
        "zero3_expert_lora_initialize": _guard(zero3_lora_initialize, rank, True),
        "zero3_attention_lora_initialize": _guard(zero3_lora_initialize, rank, False),
        "zero3_trainer_ds_optimizer_sgd": _guard(trainer_case, rank, 3, "SGD", tmp),
        "zero3_trainer_trainer_optimizer": _guard(trainer_case, rank, 3, None, tmp),
        "zero3_accelerate_ds_optimizer": _guard(accelerate_case, rank, 3, True),
        "zero3_nvme_param_trainer": _guard(zero3_offload_trainer, tmp, ("offload_param", "nvme")),
        "zero3_nvme_optimizer_trainer": _guard(zero3_offload_trainer, tmp, ("offload_optimizer", "nvme")),
        "zero3_nvme_optimizer_accelerate": _guard(accelerate_refused, 3, False, ("offload_optimizer", "nvme")),
    }
    return results


def run_zero3_mesh(rank, world, tmp):
    """ZeRO-3 on an EP 2 x DP 2 mesh (4 ranks): deepspeed.initialize and Trainer, as in :func:`run_all`."""
    return {
        "zero3_initialize_sgd": _guard(zero3_initialize_case, rank, tmp, True),
        "zero3_trainer_ds_optimizer_sgd": _guard(trainer_case, rank, 3, "SGD", tmp, True),
    }
