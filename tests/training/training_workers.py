"""Rank functions for tests/training/test_training.py: EP with DDP, expert_grad, clipping, EP x DP, generate.

Every recipe runs twice on the same ranks: with EP, and the same recipe without it (every rank holds
all experts, plain data parallel). Results come back as dicts of relative errors (and a few facts);
the test asserts on them.
"""

from __future__ import annotations

import copy
import logging
import math
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import epmoe
from epmoe.models import build_model

VOCAB = 256


def batch(step, rank, sizes):
    """Rank ``rank``'s token batch at ``step``; ``sizes[rank] = (batch, seq)`` differ per rank."""
    b, s = sizes[rank % len(sizes)]
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (b, s), generator=g)


def rel(a, b):
    assert a is not None and b is not None, "a gradient is missing (None)"
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class Pair:
    """This rank's parameter and the reference's matching part: expert shards are compared with the
    reference's slice of the same experts (ModuleList names keep global indices, packed tensors are
    sliced along the expert dim)."""

    def __init__(self, mine, ref, rows):
        self.mine, self.ref_param, self.rows = mine, ref, rows

    @property
    def param_error(self):
        return rel(self.mine, self.ref_param[self.rows])

    @property
    def param_norm_error(self):
        """``|mine - ref| / |ref|`` in the 2-norm: the relative error of the tensor as a whole."""
        diff = (self.mine.detach().double() - self.ref_param[self.rows].detach().double()).norm()
        return (diff / self.ref_param[self.rows].detach().double().norm()).item()

    @property
    def grad_error(self):
        assert self.mine.grad is not None and self.ref_param.grad is not None, "no gradient to compare"
        return rel(self.mine.grad, self.ref_param.grad[self.rows])


def reference_view(model, ref, shards):
    """``{name: Pair}`` for every parameter of ``model``."""
    by_module = {s.module_name: s for s in shards}
    ref_params = dict(ref.named_parameters())
    pairs = {}
    for name, p in model.named_parameters():
        full = ref_params[name]
        rows = slice(None)
        if p.shape != full.shape:
            shard = by_module[name.rsplit(".", 1)[0]]
            rows = slice(shard.local_start, shard.local_end)
        pairs[name] = Pair(p, full, rows)
    assert pairs, "no parameter to compare"
    return pairs


def worst(errors, prefix):
    return max((v for k, v in errors.items() if k.startswith(prefix)), default=0.0)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_checks(checks):
    out = {}
    for name, fn in checks.items():
        try:
            out[name] = fn()
        except BaseException:  # noqa: BLE001 - the test reports it
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


# --------------------------------------------------------------------------------------------
# plain DDP, clipping inside the loop


def ddp_parity(rank, world, family="qwen3_moe", steps=5, clip=0.05, dtype=torch.float64):
    """DDP(ep_model) vs DDP(unsharded), AdamW, per-rank batch sizes differ; gradients of step 0,
    clip norms of every step and parameters after ``steps`` steps, per parameter."""
    ref = build_model(family, dtype=dtype)
    model = copy.deepcopy(ref)
    records = Records()
    logging.getLogger("epmoe.ep.grads").addHandler(records)
    logging.getLogger("epmoe.ep.grads").setLevel(logging.INFO)
    shards = epmoe.apply_expert_parallel(model)
    experts = set(epmoe.expert_parameters(model))
    ddp, ddp_ref = DDP(model), DDP(ref)
    out = {"errors": {}, "facts": {}}
    errors, facts = out["errors"], out["facts"]
    # DDP kept its hands off the experts: not broadcast from rank 0 (each rank kept its own block)...
    for name, pair in reference_view(model, ref, shards).items():
        errors[f"init/{name}"] = pair.param_error
    # ...and not in its reducer
    facts["ddp_reduces_experts"] = any(p in experts for p in ddp._module_parameters)
    facts["num_experts_params"] = len(experts)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ddp_ref.parameters(), lr=1e-2)
    sizes = [(2, 12), (3, 7)]
    norms = []
    for step in range(steps):
        ids = batch(step, rank, sizes)
        ddp(ids, labels=ids).loss.backward()
        ddp_ref(ids, labels=ids).loss.backward()
        if step == 0:
            for name, pair in reference_view(model, ref, shards).items():
                errors[f"grad0/{name}"] = pair.grad_error
            inf_mine = epmoe.clip_grad_norm_(ddp, math.inf, norm_type=math.inf)
            inf_ref = torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), math.inf, norm_type=math.inf)
            errors["norm_inf"] = rel(inf_mine, inf_ref)
            one_mine = epmoe.clip_grad_norm_(list(ddp.parameters()), math.inf, norm_type=1.0)
            one_ref = torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), math.inf, norm_type=1.0)
            errors["norm_1"] = rel(one_mine, one_ref)
        norm = epmoe.clip_grad_norm_(ddp, clip)
        norm_ref = torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), clip)
        errors[f"norm/{step}"] = rel(norm, norm_ref)
        norms.append(norm.item())
        if step == 0:
            for name, pair in reference_view(model, ref, shards).items():
                errors[f"clipped0/{name}"] = pair.grad_error
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
    for name, pair in reference_view(model, ref, shards).items():
        errors[f"param/{name}"] = pair.param_error
    facts["norms"] = norms
    facts["clipped"] = all(n > clip for n in norms)
    facts["log"] = [m for m in records.messages if "expert_grad" in m]
    return out


# --------------------------------------------------------------------------------------------
# expert_grad without a wrapper, identity of expert parameters, refusals, generate


def _sum_of_rank_grads(ref, world, sizes):
    """The unsharded model's gradients of sum over ranks of each rank's loss, and this rank's own."""
    total, own = {}, {}
    for source in range(world):
        ref.zero_grad(set_to_none=True)
        ids = batch(0, source, sizes)
        ref(ids, labels=ids).loss.backward()
        for n, p in ref.named_parameters():
            total[n] = total.get(n, 0) + p.grad
            if source == dist.get_rank():
                own[n] = p.grad.clone()
    return total, own


def expert_grad_modes(rank, world):
    """No wrapper: "sum" and "auto" give the summed expert gradients, "mean" divides them by the
    world; non-expert gradients are this rank's own in every mode."""
    ref = build_model("qwen3_moe", dtype=torch.float64)
    sizes = [(2, 9), (1, 13)]
    total, own = _sum_of_rank_grads(ref, world, sizes)
    errors = {}
    for mode, divisor in (("sum", 1), ("auto", 1), ("mean", world)):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        shards = epmoe.apply_expert_parallel(model, config={"expert_grad": mode})
        ids = batch(0, rank, sizes)
        model(ids, labels=ids).loss.backward()
        by_module = {s.module_name: s for s in shards}
        for name, p in model.named_parameters():
            if epmoe.is_expert_parameter(p):
                shard = by_module[name.rsplit(".", 1)[0]]
                want = total[name][shard.local_start : shard.local_end] / divisor
            else:
                want = own[name]
            errors[f"{mode}/{name}"] = rel(p.grad, want)
    return errors


def expert_parameter_identity(rank, world):
    """expert_parameters finds the sharded weights and the LoRA factors PEFT adds on them after EP
    (by identity; not attention LoRA); DDP(peft_model) ignores exactly those, under their names."""
    from peft import LoraConfig, get_peft_model

    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    base_experts = set(epmoe.expert_parameters(model))
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    found = epmoe.expert_parameters(peft_model)
    names = {id(p): n for n, p in peft_model.named_parameters()}
    lora = [names[id(p)] for p in found if p not in base_experts]
    attention = [n for n, p in peft_model.named_parameters() if "lora_" in n and "experts" not in n]
    ddp = DDP(peft_model)
    reduced = {id(p) for p in ddp._module_parameters}
    return {
        "base": len(base_experts),
        "lora": sorted(lora),
        "all_marked": all(epmoe.is_expert_parameter(p) for p in found),
        "attention_marked": any(epmoe.is_expert_parameter(dict(peft_model.named_parameters())[n]) for n in attention),
        "ddp_reduces_experts": any(id(p) in reduced for p in found),
        "ddp_reduces_attention_lora": all(id(dict(peft_model.named_parameters())[n]) in reduced for n in attention),
    }


def refusals(rank, world):
    """apply_expert_parallel on a DDP- or FSDP2-wrapped model, and generate(synced_gpus=False)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for label in ("ddp", "fsdp2"):
        model = build_model("qwen3_moe")
        if label == "ddp":
            model = DDP(model)
        else:
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        try:
            epmoe.apply_expert_parallel(model)
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    try:
        model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, synced_gpus=False)
        out["synced_false"] = None
    except ValueError as exc:
        out["synced_false"] = str(exc)
    return out


def generate_parity(rank, world):
    """Ranks generate different numbers of new tokens from different prompts: greedy tokens equal
    the unsharded model's; seeded sampling is reproducible and equals the unsharded model's."""
    ref = build_model("qwen3_moe", dtype=torch.float64).eval()
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    prompt = batch(7, rank, [(2, 5), (1, 9)])
    kwargs = dict(max_new_tokens=3 + 6 * rank, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        greedy = model.generate(prompt, do_sample=False, **kwargs)
        greedy_ref = ref.generate(prompt, do_sample=False, **kwargs)
        sampled = []
        for _ in range(2):
            torch.manual_seed(123 + rank)
            sampled.append(model.generate(prompt, do_sample=True, top_k=0, **kwargs))
        torch.manual_seed(123 + rank)
        sampled_ref = ref.generate(prompt, do_sample=True, top_k=0, **kwargs)
    return {
        "new_tokens": greedy.shape[1] - prompt.shape[1],
        "greedy_equal": torch.equal(greedy, greedy_ref),
        "sampled_reproducible": torch.equal(sampled[0], sampled[1]),
        "sampled_equal_ref": torch.equal(sampled[0], sampled_ref),
    }


def two_rank_checks(rank, world):
    return run_checks(
        {
            "ddp": lambda: ddp_parity(rank, world),
            "ddp_module_list": lambda: {
                f"{kind}/{k}": v
                for kind, (errs, _) in ddp_module_list_parity(rank, world).items()
                for k, v in errs.items()
            },
            "ddp_gpt_oss": lambda: ddp_families(rank, world),
            "expert_grad_modes": lambda: expert_grad_modes(rank, world),
            "identity": lambda: expert_parameter_identity(rank, world),
            "refusals": lambda: refusals(rank, world),
            "generate": lambda: generate_parity(rank, world),
        }
    )


def ddp_module_list_parity(rank, world, mesh=None):
    """DDP on custom models with nn.ModuleList experts (stacked grouped path, and experts run by their
    own forward with gradient hooks), EP over the world or over ``mesh``'s "ep" dim: gradients and
    parameters after 3 SGD steps, per parameter. Returns ``{kind: (errors, dp replicas equal)}``."""
    from custom_moe import BiasedExpert, ExpertMLP, TinyMoELM

    out = {}
    for kind, expert_cls in (("mlp", ExpertMLP), ("biased", BiasedExpert)):
        torch.manual_seed(0)
        ref = TinyMoELM(expert_cls=expert_cls).double()
        model = copy.deepcopy(ref)
        shards = epmoe.apply_expert_parallel(model, mesh)
        ddp, ddp_ref = DDP(model), DDP(ref)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        opt_ref = torch.optim.SGD(ddp_ref.parameters(), lr=0.5)
        errors = {}
        for step in range(3):
            ids = batch(step, rank, [(2, 6), (3, 4), (1, 7), (2, 5)]) % 64
            ddp(ids).square().mean().backward()
            ddp_ref(ids).square().mean().backward()
            for name, pair in reference_view(model, ref, shards).items():
                errors[f"grad{step}/{name}"] = pair.grad_error
            opt.step()
            opt_ref.step()
            opt.zero_grad(set_to_none=True)
            opt_ref.zero_grad(set_to_none=True)
        for name, pair in reference_view(model, ref, shards).items():
            errors[f"param/{name}"] = pair.param_error
        out[kind] = (errors, mesh is None or _replicas_equal(model, mesh))
    return out


def ddp_families(rank, world):
    """DDP parity (3 steps) for GPT-OSS: biased, transposed experts (four tensors per experts module)."""
    out = ddp_parity(rank, world, family="gpt_oss", steps=3)
    return out["errors"]


# --------------------------------------------------------------------------------------------
# EP x DP on 4 ranks


def ep_dp_mesh(rank, world, steps=4):
    """A ("dp", "ep") = (2, 2) mesh: experts sharded over "ep", replicated over "dp", reduced over "dp"
    by epmoe; DDP over all 4 ranks for the rest; vs 4-rank non-EP DDP. Expert replicas across "dp"
    stay bitwise identical; the clip norm counts each expert once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model, mesh)
    ddp, ddp_ref = DDP(model), DDP(ref)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ddp_ref.parameters(), lr=1e-2)
    errors, norms = {}, []
    sizes = [(2, 8), (1, 11), (3, 5), (2, 6)]
    for step in range(steps):
        ids = batch(step, rank, sizes)
        ddp(ids, labels=ids).loss.backward()
        ddp_ref(ids, labels=ids).loss.backward()
        if step == 0:
            for name, pair in reference_view(model, ref, shards).items():
                errors[f"grad0/{name}"] = pair.grad_error
        norm = epmoe.clip_grad_norm_(ddp, 0.05)
        norm_ref = torch.nn.utils.clip_grad_norm_(ddp_ref.parameters(), 0.05)
        errors[f"norm/{step}"] = rel(norm, norm_ref)
        norms.append(norm.item())
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
    for name, pair in reference_view(model, ref, shards).items():
        errors[f"param/{name}"] = pair.param_error
    replicas_equal = _replicas_equal(model, mesh)
    errors.update({f"frozen/{k}": v for k, v in frozen_experts_ep_dp(rank, mesh).items()})
    for kind, (errs, equal) in ddp_module_list_parity(rank, world, mesh).items():
        errors.update({f"{kind}/{k}": v for k, v in errs.items()})
        replicas_equal &= equal
    return {"errors": errors, "replicas_equal": replicas_equal, "ep_size": shards[0].ep_size, "norms": norms}


def frozen_experts_ep_dp(rank, mesh):
    """The (2, 2) mesh with every experts module's down_proj frozen: it gets no gradient (the "dp"
    reduction skips it) and 2 AdamW steps equal non-EP DDP's, per parameter."""
    ref = build_model("qwen3_moe", dtype=torch.float64)
    for layer in ref.model.layers:
        layer.mlp.experts.down_proj.requires_grad_(False)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model, mesh)
    ddp, ddp_ref = DDP(model), DDP(ref)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
    opt_ref = torch.optim.AdamW([p for p in ddp_ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        ids = batch(step, rank, [(2, 8), (1, 11), (3, 5), (2, 6)])
        ddp(ids, labels=ids).loss.backward()
        ddp_ref(ids, labels=ids).loss.backward()
        assert all(layer.mlp.experts.down_proj.grad is None for layer in model.model.layers)
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
    return {f"param/{name}": pair.param_error for name, pair in reference_view(model, ref, shards).items()}


def _replicas_equal(model, mesh):
    """Whether the experts on ranks r and r +- 2 (replicas over "dp") are equal bit for bit."""
    equal = True
    for p in epmoe.expert_parameters(model):
        gathered = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(gathered, p.detach().contiguous(), group=mesh.get_group("dp"))
        equal &= torch.equal(gathered[0], gathered[1])
    return equal


# --------------------------------------------------------------------------------------------
# transformers.Trainer


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n, seq, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_parity_both(rank, world, out_dir):
    return {
        dtype: trainer_parity(rank, world, f"{out_dir}/{dtype}", dtype_name=dtype) for dtype in ("float64", "float32")
    }


def trainer_log(log: list[dict], key: str) -> list[float]:
    """The values of ``key`` (``"loss"``, ``"grad_norm"``) Trainer logged, in step order."""
    return [entry[key] for entry in log if key in entry]


def trainer_log_errors(log: list[dict], log_ref: list[dict], eval_loss: float, eval_ref: float) -> dict[str, float]:
    """Relative differences of each logged grad norm and loss, and of the eval loss, to the reference run's."""
    errors = {}
    for key in ("grad_norm", "loss"):
        for step, (a, b) in enumerate(zip(trainer_log(log, key), trainer_log(log_ref, key))):
            errors[f"{key}/{step}"] = abs(a - b) / abs(b)
    errors["eval_loss"] = abs(eval_loss - eval_ref) / abs(eval_ref)
    return errors


def trainer_parity(rank, world, out_dir, steps=6, dtype_name="float32", config=None):
    """transformers.Trainer on 2 ranks with its defaults (AdamW, max_grad_norm=1.0) plus gradient
    checkpointing and gradient accumulation 2: the EP model (``config``: its ExpertParallelConfig)
    through ``prepare_trainer`` (on a Trainer subclass) vs the unsharded model through a plain Trainer. Per-parameter errors after ``steps``
    steps (float64: element-wise; float32: of each tensor in the 2-norm, since AdamW turns the
    rounding of near-zero gradients into full-size update differences of single elements), the
    logged grad norms and losses, and the evaluation loss; then ``save_model`` and a plain reload."""
    from transformers import Trainer, TrainingArguments

    class SubclassedTrainer(Trainer):  # what TRL's SFTTrainer and friends are
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def args(tag):
        return TrainingArguments(
            output_dir=f"{out_dir}/{tag}",
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=steps,
            learning_rate=1e-3,
            gradient_checkpointing=True,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
        )

    train, evaluation = TokenDataset(64, 12, seed=1), TokenDataset(6, 12, seed=2)
    ref = build_model("qwen3_moe", dtype=getattr(torch, dtype_name))
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model, config=config)
    trainer_ref = Trainer(model=ref, args=args("ref"), train_dataset=train, eval_dataset=evaluation)
    trainer_ref.train()
    eval_ref = trainer_ref.evaluate()["eval_loss"]
    trainer = epmoe.prepare_trainer(
        SubclassedTrainer(model=model, args=args("ep"), train_dataset=train, eval_dataset=evaluation)
    )
    assert epmoe.prepare_trainer(trainer) is trainer  # idempotent
    trainer.train()
    eval_ep = trainer.evaluate()["eval_loss"]

    pairs = reference_view(model, ref, shards).items()
    errors = {
        f"param/{name}": pair.param_error if dtype_name == "float64" else pair.param_norm_error for name, pair in pairs
    }
    norms = trainer_log(trainer.state.log_history, "grad_norm")
    errors.update(trainer_log_errors(trainer.state.log_history, trainer_ref.state.log_history, eval_ep, eval_ref))
    # Trainer.save_model: every rank joins, the writer writes all experts; plain transformers reloads them
    from transformers import AutoModelForCausalLM

    trainer.save_model(f"{out_dir}/saved")
    loaded = AutoModelForCausalLM.from_pretrained(f"{out_dir}/saved", dtype=getattr(torch, dtype_name))
    saved = reference_view(model, loaded, shards)
    errors.update({f"saved/{name}": pair.param_error for name, pair in saved.items()})
    # the non-expert weights are identical on every rank (a per-rank clip factor would split them)
    non_expert = torch.cat([p.detach().reshape(-1) for p in model.parameters() if not epmoe.is_expert_parameter(p)])
    gathered = [torch.empty_like(non_expert) for _ in range(world)]
    dist.all_gather(gathered, non_expert)
    return {
        "errors": errors,
        "norms": norms,
        "num_steps": len(norms),
        "replicated_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "checkpointing": model.is_gradient_checkpointing,
        "transport": sorted({state.transport.name for _, _, state in epmoe.ep.state.ep_states(model)}),
    }


def trainer_resume(rank, world, out_dir, steps=6):
    """A prepared Trainer checkpointing every 2 steps trains 6 steps; a fresh prepared Trainer (other
    initial weights) resumes from the step-4 checkpoint and trains to 6: the same parameters, per
    parameter (fp64), and the same logged losses of steps 5-6."""
    from transformers import Trainer, TrainingArguments

    def run(tag, seed, resume=None):
        model = build_model("qwen3_moe", dtype=torch.float64, seed=seed)
        shards = epmoe.apply_expert_parallel(model)
        args = TrainingArguments(
            output_dir=f"{out_dir}/run",
            per_device_train_batch_size=2,
            max_steps=steps,
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
        trainer = epmoe.prepare_trainer(Trainer(model=model, args=args, train_dataset=TokenDataset(64, 12, seed=1)))
        trainer.train(resume_from_checkpoint=resume)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        return model, shards, losses

    model, shards, losses = run("full", 0)
    dist.barrier()
    resumed, _, losses2 = run("resumed", 99, resume=f"{out_dir}/run/checkpoint-4")
    errors = {f"param/{name}": pair.param_error for name, pair in reference_view(resumed, model, shards).items()}
    errors.update({f"loss/{step}": abs(losses2[step] - losses[step]) / abs(losses[step]) for step in (5, 6)})
    return errors
