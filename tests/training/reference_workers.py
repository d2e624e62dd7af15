"""Rank functions for reference models that stay expert-parallel (module level, so spawned ranks can import them)."""

import copy
import gc
import weakref

import torch
import torch.distributed as dist
from grpo_workers import EOS, PAD, _base_model, _tokenizer

import epmoe


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


EAGER = {"experts_implementation": "eager"}  # fp64 on CPU: torch's grouped_mm takes no float64


def _dpo_trainer(model, out_dir):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    words = [f"w{i}" for i in range(60)]
    pairs = Dataset.from_dict(
        {
            "prompt": [" ".join(words[(5 * i + j) % 60] for j in range(2 + i % 3)) for i in range(8)],
            "chosen": [" ".join(words[(3 * i + j) % 60] for j in range(1 + i % 4)) for i in range(8)],
            "rejected": [" ".join(words[(11 * i + j) % 60] for j in range(2 + i % 2)) for i in range(8)],
        }
    )
    args = DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=5e-2,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        bf16=False,
        model_init_kwargs=EAGER,
    )  # the reference TRL loads from the path
    return DPOTrainer(model=model, ref_model=None, args=args, train_dataset=pairs, processing_class=_tokenizer())


def _grpo_trainer(model, out_dir):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_dict(
        {"prompt": [" ".join(f"w{(7 * i + j) % 60}" for j in range(2 + i % 3)) for i in range(16)]}
    )
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=5e-2,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        bf16=False,
        beta=0.5,  # a KL term: TRL loads a reference
        model_init_kwargs=EAGER,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [float(len(c.split())) for c in completions],
        args=args,
        train_dataset=prompts,
        processing_class=_tokenizer(),
    )


def _train(path, out_dir, ep, make_trainer):
    """Two steps of ``make_trainer``'s trainer on the model saved at ``path`` with ``ref_model=None``
    (TRL loads the reference from the path, unsharded); returns ``(policy, checks)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **EAGER)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = PAD, EOS
    if ep:
        epmoe.apply_expert_parallel(model)
    trainer = make_trainer(model, out_dir)
    checks = {}
    if ep:
        unsharded = weakref.ref(trainer.ref_model)
        checks["unsharded_bytes"] = _param_bytes(trainer.ref_model)
        epmoe.prepare_trainer(trainer)
        gc.collect()
        checks["unsharded_freed"] = unsharded() is None
        checks["ref_bytes"] = _param_bytes(trainer.ref_model)
        checks["policy_bytes"] = _param_bytes(model)
        checks["ref_is_ep"] = epmoe.ep_model(trainer.ref_model) is not None
        checks["ref_frozen"] = not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    checks["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return model, checks


def reference_parity(rank, world, out_dir):
    """DPO and GRPO (a KL term) with ``ref_model=None`` at EP ``world`` against the same run without
    EP (DDP): every parameter after two steps (an expert shard against its rows of the unsharded
    parameter); the EP run's reference holds only the local experts."""
    path = f"{out_dir}/model"
    if rank == 0:
        _base_model().save_pretrained(path)
    dist.barrier()
    out = {}
    for name, make_trainer in (("dpo", _dpo_trainer), ("grpo", _grpo_trainer)):
        ep_model, ep_checks = _train(path, f"{out_dir}/{name}_ep", True, make_trainer)
        ddp_model, ddp_checks = _train(path, f"{out_dir}/{name}_ddp", False, make_trainer)
        reference = dict(ddp_model.named_parameters())
        worst = 0.0
        for param_name, param in ep_model.named_parameters():
            full = reference[param_name]
            if param.shape != full.shape:  # an expert shard: this rank's rows
                full = full[rank * param.shape[0] : (rank + 1) * param.shape[0]]
            worst = max(worst, ((param - full).abs().max() / full.abs().max().clamp_min(1e-12)).item())
        out[name] = {"max_rel": worst, "ep": ep_checks, "ddp_losses": ddp_checks["losses"]}
    return out


def reference_weights(rank, world):
    """``reference_model(model, weights_from=unsharded)`` at EP ``world``: its outputs equal the
    unsharded model's on this rank's batch, for packed and ``nn.ModuleList`` experts, and it holds
    only the local experts."""
    from custom_moe import TinyMoELM

    from epmoe.models import build_model

    out = {}
    for family in ("qwen3_moe", "module_list"):
        torch.manual_seed(0)
        policy = TinyMoELM().double() if family == "module_list" else build_model(family, dtype=torch.float64)
        other = copy.deepcopy(policy)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.1 * torch.randn_like(p))
        epmoe.apply_expert_parallel(policy)
        ref = epmoe.reference_model(policy, weights_from=other)
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            got, want = ref(ids), other(ids)
        got, want = getattr(got, "logits", got), getattr(want, "logits", want)
        out[family] = {
            "max_abs": (got - want).abs().max().item(),
            "ref_bytes": _param_bytes(ref),
            "policy_bytes": _param_bytes(policy),
            "full_bytes": _param_bytes(other),
            "frozen": not any(p.requires_grad for p in ref.parameters()),
            "eval": not ref.training,
        }
    return out
