"""Rank functions for TRL's GRPOTrainer with rollout routing replay (module level, so spawned ranks can import them)."""

import copy

import torch
import torch.distributed as dist

import epmoe
from epmoe.models import build_model

PAD, EOS = 64, 65


def _tokenizer():
    """A word-level tokenizer over ``w0 .. w63`` built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(64)} | {"<pad>": PAD, "<eos>": EOS}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def _base_model():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 30  # EOS likely enough that completions end at different lengths
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = PAD, EOS
    return model


def _reward(completions, **_):
    return [float(len(text.split())) for text in completions]


def _train(base, out_dir, ep):
    """Two GRPO steps from one generation batch (the second step's model is not the rollout's), routes
    replayed; returns ``(model, checks)``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = copy.deepcopy(base)
    if ep:
        epmoe.apply_expert_parallel(model)
    prompts = Dataset.from_dict(
        {"prompt": [" ".join(f"w{(7 * i + j) % 60}" for j in range(2 + i % 3)) for i in range(16)]}
    )
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=4,
        max_completion_length=5,
        max_steps=2,
        learning_rate=5e-2,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        bf16=False,
        gradient_checkpointing=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=_reward, args=args, train_dataset=prompts, processing_class=_tokenizer()
    )
    if ep:
        epmoe.prepare_trainer(trainer)
    epmoe.replay_rollout_routing(trainer)
    checks = {"replayed": 0, "routes_followed": True, "flips": 0, "lengths": []}
    compute_loss = trainer._compute_loss

    def checked(model_, inputs):  # a record taken during the replay holds the micro-batch's routes
        sequences = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        with torch.no_grad(), epmoe.record_routing(trainer.model) as live:  # before the replay opens
            trainer.model(sequences, attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))
        with epmoe.record_routing(model_) as seen:
            loss = compute_loss(model_, inputs)
        routes = inputs["routes"].transpose(0, 1)
        covered = routes >= 0
        checks["replayed"] += int(covered.any())
        checks["routes_followed"] &= bool(torch.equal(seen.routes_by_position()[covered], routes[covered]))
        checks["flips"] += int((live.routes_by_position()[covered] != routes[covered]).sum())
        checks["lengths"].append(int(inputs["completion_mask"].sum()))
        return loss

    trainer._compute_loss = checked
    trainer.train()
    return model, checks


def grpo_replay_parity(rank, world, out_dir):
    """GRPO at EP ``world`` against the same GRPO without EP (DDP), both replaying the rollouts' routes:
    every parameter after two steps (an expert shard against its rows of the unsharded parameter)."""
    base = _base_model()
    ep_model, ep_checks = _train(base, f"{out_dir}/ep", ep=True)
    ddp_model, ddp_checks = _train(base, f"{out_dir}/ddp", ep=False)
    reference, initial = dict(ddp_model.named_parameters()), dict(base.named_parameters())
    worst, moved = 0.0, 0.0
    for name, param in ep_model.named_parameters():
        full, start = reference[name], initial[name]
        if param.shape != full.shape:  # an expert shard: this rank's rows
            rows = slice(rank * param.shape[0], (rank + 1) * param.shape[0])
            full, start = full[rows], start[rows]
        worst = max(worst, ((param - full).abs().max() / full.abs().max().clamp_min(1e-12)).item())
        moved = max(moved, (param - start).abs().max().item())
    lengths = [None] * world
    dist.all_gather_object(lengths, ep_checks["lengths"])
    return {"max_rel": worst, "moved": moved, "ep": ep_checks, "ddp": ddp_checks, "lengths_by_rank": lengths}
