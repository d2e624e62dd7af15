"""Rank functions for tests/training/test_accelerate.py: the usual clipping idioms on an EP model.

Exact paths (a prepared accelerate ``Accelerator``) run against the same recipe without EP (every
rank holding all experts, plain data parallel) and return per-parameter relative errors; the idioms
epmoe cannot make exact (torch's own clip, an unprepared accelerator or Trainer, replicas that
drifted) return where and with what they stopped.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from training_workers import TokenDataset, batch, reference_view, rel, run_checks

import epmoe
from epmoe import ExpertParallelConfig
from epmoe.models import build_model

SIZES = [(2, 10), (3, 6)]
SUM_OF_TOKENS = sum(b * t for b, t in SIZES)


def replicas_equal(model, world):
    """Whether every non-expert parameter is bitwise the same on every rank (counted: nothing
    compared is a failure)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters() if not epmoe.is_expert_parameter(p)])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return flat.numel() > 0 and all(torch.equal(gathered[0], g) for g in gathered)


def accelerate_loop(accelerator, model, steps, rank, clip=0.05, dtype=torch.float64):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    norms = []
    for step in range(steps):
        ids = batch(step, rank, SIZES)
        accelerator.backward(model(ids, labels=ids).loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return norms


def accelerate_parity(rank, world, steps=4):
    """prepare_accelerator + accelerator.prepare (DDP) + accelerator.clip_grad_norm_, AdamW x 4, vs
    the same loop on the unsharded model with a plain Accelerator: norms and every parameter."""
    from accelerate import Accelerator

    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    accelerator = epmoe.prepare_accelerator(Accelerator(cpu=True))
    assert epmoe.prepare_accelerator(accelerator) is accelerator  # idempotent
    norms = accelerate_loop(accelerator, model, steps, rank)
    norms_ref = accelerate_loop(Accelerator(cpu=True), ref, steps, rank)
    errors = {f"norm/{i}": rel(a, b) for i, (a, b) in enumerate(zip(norms, norms_ref))}
    errors.update({f"param/{n}": pair.param_error for n, pair in reference_view(model, ref, shards).items()})
    return {
        "errors": errors,
        "norms": [n.item() for n in norms],
        "distributed": str(accelerator.distributed_type),
        "replicas_equal": replicas_equal(model, world),
    }


def stops(rank, world, idiom, steps=4):
    """An EP model under DDP trained ``steps`` steps with ``idiom`` clipping (or other in-place
    mischief); ``{"step": the step whose forward raised, "error": its message}`` or ``{"step": None}``."""
    from accelerate import Accelerator

    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model, config=ExpertParallelConfig(check_steps=idiom != "torch_clip_unchecked"))
    if idiom == "accelerate_unprepared":
        accelerator = Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ddp, opt = accelerator.prepare(model, opt)
    else:
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    step = None
    try:
        for step in range(steps):
            ids = batch(step, rank, SIZES)
            loss = ddp(ids, labels=ids).loss
            if idiom == "accelerate_unprepared":
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(ddp.parameters(), 1.0)
            else:
                loss.backward()
            if idiom in ("torch_clip", "torch_clip_unchecked"):
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            elif idiom == "token_count_then_epmoe":  # the same factor on every rank (twinkle's normalisation)
                for p in ddp.parameters():
                    p.grad.div_(SUM_OF_TOKENS)
                epmoe.clip_grad_norm_(ddp, 1.0)
            elif idiom == "token_count_only":
                for p in ddp.parameters():
                    p.grad.div_(SUM_OF_TOKENS)
            elif idiom == "per_rank_scale":  # a different factor on each rank, though no clip
                for p in ddp.parameters():
                    p.grad.mul_(0.5 + 0.25 * rank)
            elif idiom == "torch_clip_no_op":  # no rank's own norm reaches max_norm: torch's clip multiplies by 1
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e9)
            elif idiom == "epmoe_then_zero_in_place":  # exact: epmoe's clip, zero_grad(set_to_none=False)
                epmoe.clip_grad_norm_(ddp, 1.0)
            opt.step()
            if idiom == "drift" and step == 1 and rank == 1:  # one rank's replica nudged by one ulp
                with torch.no_grad():
                    w = model.model.norm.weight
                    w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(10.0, dtype=w.dtype))
            opt.zero_grad(set_to_none=idiom != "epmoe_then_zero_in_place")
        return {"step": None, "error": None, "replicas_equal": replicas_equal(model, world)}
    except RuntimeError as exc:
        return {"step": step, "error": str(exc)}


def trainer_unprepared(rank, world, out_dir):
    """A Trainer (max_grad_norm=1.0, its default) on an EP model without prepare_trainer."""
    from transformers import Trainer, TrainingArguments

    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "unprepared"),
        per_device_train_batch_size=2,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(32, 12, seed=1))
    try:
        trainer.train()
        return {"step": None, "error": None}
    except RuntimeError as exc:
        return {"step": trainer.state.global_step, "error": str(exc)}


def two_rank_checks(rank, world, out_dir):
    checks = {"accelerate": lambda: accelerate_parity(rank, world)}
    idioms = ("torch_clip", "torch_clip_no_op", "accelerate_unprepared", "drift", "epmoe_then_zero_in_place")
    idioms += ("token_count_then_epmoe", "token_count_only", "per_rank_scale", "torch_clip_unchecked")
    for idiom in idioms:
        checks[idiom] = lambda idiom=idiom: stops(rank, world, idiom)
    checks["trainer_unprepared"] = lambda: trainer_unprepared(rank, world, out_dir)
    return run_checks(checks)
