"""Rank functions for the launcher tests (module level, so spawned ranks can import them): the paths
users take around epmoe (deep copies, groups made after other groups, dtypes, timeouts, Auto classes)."""

import copy
import datetime
import time

import torch
import torch.distributed as dist

import epmoe
from epmoe.models import build_model

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def batch_of(rank, batch=2, length=9, vocab=64):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (batch, length), generator=g)


def ep_vs_unsharded_grads(model, ref, rank, world):
    """Max relative difference, per parameter, between the EP ``model``'s gradients on this rank's
    batch and the unsharded ``ref``'s: other parameters on the same batch, expert slices summed over
    every rank's batch (the EP contract). Both models' gradients are set here."""
    model.zero_grad()
    ids = batch_of(rank)
    model(ids, labels=ids).loss.backward()
    grads = {}
    for source in range(world):
        ref.zero_grad()
        ids = batch_of(source)
        ref(ids, labels=ids).loss.backward()
        for name, p in ref.named_parameters():
            if source == rank or name.endswith(EXPERTS):
                grads[name] = grads.get(name, 0) + p.grad
    local = {}
    for name, p in model.named_parameters():
        expected = grads[name]
        if name.endswith(EXPERTS):
            e = p.shape[0]
            expected = expected[rank * e : (rank + 1) * e]
        scale = expected.abs().max().clamp_min(1e-12)
        local[name] = ((p.grad - expected).abs().max() / scale).item()
    assert local, "compared nothing"
    return max(local.values()), len(local)


def deep_copies(rank, world):
    """``copy.deepcopy`` of an EP model (and TRL's ``create_reference_model``): an independent EP model
    whose outputs and gradients equal the unsharded model's, with its own weights."""
    torch.manual_seed(0)
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    twin = copy.deepcopy(model)
    out = {"twin_vs_unsharded": ep_vs_unsharded_grads(twin, ref, rank, world)}
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    out["original_untouched"] = all(
        torch.equal(p, q)
        for (n, p), (_, q) in zip(model.named_parameters(), copy.deepcopy(ref).named_parameters())
        if not n.endswith(EXPERTS)
    )
    out["twin_moved"] = any(not torch.equal(p, q) for p, q in zip(twin.parameters(), model.parameters()))
    out["copy_is_ep"] = len(epmoe.expert_parameters(twin)) == 2 * len(twin.model.layers)
    out["original_vs_unsharded"] = ep_vs_unsharded_grads(model, ref, rank, world)
    from trl import create_reference_model

    frozen = create_reference_model(model)
    ids = batch_of(rank)
    with torch.no_grad():
        out["reference_model_logits"] = (frozen(ids).logits - ref(ids).logits).abs().max().item()
    out["reference_model_frozen"] = not any(p.requires_grad for p in frozen.parameters())
    return out


def dtype_on_one_rank(rank, world):
    """One rank casts its EP model to bf16 after apply_expert_parallel: every rank raises a clear
    ValueError at the next forward (no abort inside gloo)."""
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model, config={"timeout": 30})
    if rank == 1:
        model.to(torch.bfloat16)
    ids = batch_of(rank)
    start = time.monotonic()
    try:
        model(ids)
    except ValueError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def shorter_group_timeout(rank, world):
    """A process group whose timeout is shorter than epmoe's default bounds epmoe's waits too."""
    from epmoe.comm.steps import group_timeout_s, step_timeout_s

    short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=7))
    return group_timeout_s(short), step_timeout_s(None, short), step_timeout_s(None, None), step_timeout_s(3, short)


def groups_after_other_groups(rank, world):
    """Ranks 0 and 1 train an EP model on their own pair first; then EP over all ranks must still form
    its groups (their names may not depend on what a process did before)."""
    torch.manual_seed(0)
    pair = dist.new_group([0, 1])
    dist.new_group([2, 3])  # every rank takes part in creating every group
    if rank < 2:
        first = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(first, pair)
        ids = batch_of(rank)
        first(ids, labels=ids).loss.backward()
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model, config={"timeout": 60})
    return ep_vs_unsharded_grads(model, ref, rank, world)


def auto_class_loading(rank, world, path):
    """``epmoe.from_pretrained`` takes Auto classes: same weights and logits as the concrete class."""
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    auto, auto_shards = epmoe.from_pretrained(AutoModelForCausalLM, path, dtype=torch.float64)
    concrete, shards = epmoe.from_pretrained(Qwen3MoeForCausalLM, path, dtype=torch.float64)
    ids = batch_of(rank)
    same = all(torch.equal(p, q) for p, q in zip(auto.parameters(), concrete.parameters()))
    with torch.no_grad():
        diff = (auto(ids).logits - concrete(ids).logits).abs().max().item()
    return type(auto).__name__, same, diff, auto_shards == shards


def launcher_cases(rank, world, root):
    """Every 2-rank case of tests/training/test_launchers.py in one spawn: ``{case: result}``."""
    results = {}
    for name, run in (
        ("deep_copies", lambda: deep_copies(rank, world)),
        ("dtype_on_one_rank", lambda: dtype_on_one_rank(rank, world)),
        ("shorter_group_timeout", lambda: shorter_group_timeout(rank, world)),
        ("auto_class_loading", lambda: auto_class_loading(rank, world, f"{root}/model")),
        ("fsdp2_saves", lambda: fsdp2_saves(rank, world, root)),
        ("parameter_counts", lambda: parameter_counts(rank, world)),
    ):
        results[name] = run()
        dist.barrier()
    return results


# --------------------------------------------------------------------------------------------
# Saves under FSDP2, resume at another world size, parameter counts


def fsdp2_saves(rank, world, root):
    """The FSDP2 recipe of docs/training.md, then ``model.save_pretrained`` on every rank; EP + FSDP2 +
    LoRA, then the adapter save of docs/checkpoints.md: plain transformers / peft reload each exactly
    (logits vs the EP model's)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    def sharded(model, base):
        experts = set(epmoe.expert_parameters(model))
        mesh = init_device_mesh("cpu", (world,))
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=experts)
        fully_shard(base, mesh=mesh, ignored_params=experts)
        return model

    def one_step(model):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        ids = batch_of(rank)
        model(ids, labels=ids).loss.backward()
        epmoe.clip_grad_norm_(model, 1.0)
        opt.step()

    out = {}
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    sharded(model, model)
    one_step(model)
    model.save_pretrained(f"{root}/full")
    plain = AutoModelForCausalLM.from_pretrained(f"{root}/full", dtype=torch.float64, experts_implementation="eager")
    ids = batch_of(rank)
    with torch.no_grad():
        out["full"] = (model(ids).logits - plain(ids).logits).abs().max().item()

    torch.manual_seed(0)
    base = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(base)
    config = LoraConfig(
        r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj", "v_proj"], target_parameters=list(EXPERTS)
    )
    peft_model = sharded(get_peft_model(base, config), base)
    one_step(peft_model)
    peft_model.save_pretrained(
        f"{root}/adapter", state_dict=epmoe.adapter_state_dict(peft_model), is_main_process=rank == 0
    )
    dist.barrier()
    torch.manual_seed(0)
    unsharded = PeftModel.from_pretrained(build_model("qwen3_moe", dtype=torch.float64), f"{root}/adapter")
    with torch.no_grad():
        out["adapter"] = (peft_model(ids).logits - unsharded(ids).logits).abs().max().item()
    return out


def trainer_run(rank, world, out_dir, *, ep, max_steps, resume=None):
    """A prepared Trainer (``ep``) or a plain one (the unsharded twin) on the fp64 model, saving a
    checkpoint every 2 steps; ``(model, shards)`` after ``max_steps``."""
    from training_workers import TokenDataset
    from transformers import Trainer, TrainingArguments

    if ep or resume is None:
        model = build_model("qwen3_moe", dtype=torch.float64, seed=0)
    else:  # transformers' Trainer reloads packed experts without its weight conversion (they stay as
        # they are): the plain twin starts from the checkpoint's weights, loaded the way that converts
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resume, dtype=torch.float64, experts_implementation="eager")
    shards = epmoe.apply_expert_parallel(model) if ep else None
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(64, 12, seed=1))
    if ep:
        epmoe.prepare_trainer(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return model, shards


def resume_checkpoints(rank, world, root, resume_from):
    """Train EP and unsharded twins to step 2 (checkpoint-2) at this world size, or, with
    ``resume_from`` (the root of another world size's run), resume both from their checkpoint-2 to
    step 4 here: every parameter of the EP model vs its twin."""
    from training_workers import reference_view

    if resume_from is None:
        for ep in (True, False):
            trainer_run(rank, world, f"{root}/{'ep' if ep else 'ref'}", ep=ep, max_steps=2)
        return None
    model, shards = trainer_run(
        rank, world, f"{root}/ep", ep=True, max_steps=4, resume=f"{resume_from}/ep/checkpoint-2"
    )
    ref, _ = trainer_run(rank, world, f"{root}/ref", ep=False, max_steps=4, resume=f"{resume_from}/ref/checkpoint-2")
    errors = {name: pair.param_error for name, pair in reference_view(model, ref, shards).items()}
    assert errors, "compared nothing"
    moved = max(
        (p.detach() - q.detach()).abs().max().item()
        for p, q in zip(ref.parameters(), build_model("qwen3_moe", dtype=torch.float64, seed=0).parameters())
    )
    return max(errors.values()), len(errors), moved


def parameter_counts(rank, world):
    """``model.num_parameters()`` of an EP model counts every expert, as the unsharded model does."""
    ref = build_model("qwen3_moe")
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    for layer in model.model.layers:
        layer.mlp.experts.down_proj.requires_grad_(False)
        layer.self_attn.q_proj.weight.requires_grad_(False)
    for layer in ref.model.layers:
        layer.mlp.experts.down_proj.requires_grad_(False)
        layer.self_attn.q_proj.weight.requires_grad_(False)
    return (
        [
            model.num_parameters(),
            model.num_parameters(only_trainable=True),
            model.num_parameters(exclude_embeddings=True),
        ],
        [ref.num_parameters(), ref.num_parameters(only_trainable=True), ref.num_parameters(exclude_embeddings=True)],
        epmoe.parameter_counts(model),
        (ref.num_parameters(only_trainable=True), ref.num_parameters()),
    )


def exits_quietly(rank, world):
    """Rank 1 leaves with exit code 0 and no word; rank 0 then fails in a collective with it."""
    import os

    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    dist.barrier()
    return "unreachable"


def what_a_rank_sees(rank, world):
    """This rank's process id and its ``EPMOE_PROBE`` environment variable."""
    import os

    return os.getpid(), os.environ.get("EPMOE_PROBE")
