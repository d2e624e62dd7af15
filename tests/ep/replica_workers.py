"""Rank functions for tests/ep/test_replicas.py (module level, so spawned ranks can import them).

Expert replicas (``ExpertParallelConfig(replicas=N)``) against the same EP model without them and
the unsharded one, experts module and whole model. The cost model would move nothing at these small
test shapes on a CPU (the weights cost more to send than their rows to compute), so the exactness
runs set every link's price to zero (:data:`FREE_LINK`): every imbalance then moves; one run keeps
the link costs measured at apply and checks that nothing moves.
"""

from __future__ import annotations

import contextlib
import copy
import zlib

import torch
import torch.distributed as dist
from ep_layer_workers import base_model as layer_base_model
from ep_layer_workers import compare_case, experts_of

import epmoe
from epmoe.ep import layer as layer_module
from epmoe.models import build_model

# routing cases: name -> (top_k, tokens per rank, kind, argument); "zipf": expert g drawn with weight 1/(g+1)^arg
SKEWED = {
    "zipf_k2": (2, [24, 17], "zipf", 1.5),
    "hot_expert_k2": (2, [20, 13], "one_expert", 1),
    "hot_rank_k4": (4, [16, 11], "avoid_rank", 1),  # every slot on rank 0's experts (at EP 2)
    "uniform_k2": (2, [16, 16], "random", None),
    "rank_with_zero_tokens": (2, [0, 21], "zipf", 2.0),
    "expert_without_tokens": (2, [18, 18], "skip_expert", 6),
}


FREE_LINK = {"flops_per_link_byte": 0.0}  # a byte costs nothing on any link: every imbalance is worth a move


def with_replicas(replicas: int = 2, **options) -> dict:
    """The replicas arms' config: ``replicas`` at a free link (:data:`FREE_LINK`), ``options`` added."""
    return {"replicas": replicas, **FREE_LINK, **options} if replicas else options


@contextlib.contextmanager
def recorded_plans():
    """Every replica plan the layers make inside the block (a list of the plans' moves)."""
    plans, plan = [], layer_module._replica_plan

    def record(*args, **kwargs):
        made = plan(*args, **kwargs)
        plans.append(() if made is None else made.moves)
        return made

    layer_module._replica_plan = record
    try:
        yield plans
    finally:
        layer_module._replica_plan = plan


def base_model():
    """The small Qwen3-MoE in float64 with O(0.1) expert weights (ep_layer_workers')."""
    return layer_base_model("qwen3_moe")


def module_cases(rank, world, cases, replicas=2):
    """Each routing case on the experts module with replicas, against the unsharded module and the
    same EP module without replicas: relative errors, and the moves each case's plan made."""
    model = base_model()
    ref = copy.deepcopy(experts_of(model))
    plain = copy.deepcopy(model)
    epmoe.apply_expert_parallel(model, config=with_replicas(replicas))
    epmoe.apply_expert_parallel(plain)
    out = {}
    for name, case in cases.items():
        seed = zlib.crc32(name.encode())
        with recorded_plans() as plans:
            errors, zeros = compare_case(
                name, case, ref, experts_of(model), list(range(world)), rank, torch.float64, seed
            )
        plain_errors, _ = compare_case(
            name, case, ref, experts_of(plain), list(range(world)), rank, torch.float64, seed
        )
        out[name] = {"errors": errors, "exact_zero": zeros, "plain": plain_errors, "moves": len(plans[0])}
    return out


# --------------------------------------------------------------------------------------------
# the whole model: recipes against the same EP model without replicas and the unsharded model


def skewed_model(hot: float = 3.0):
    """The small Qwen3-MoE in float64, every router's expert 0 scaled up: its routes carry about
    twice the mean slots (``hot``: the scale)."""
    model = build_model("qwen3_moe", dtype=torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[0] *= hot
    return model


def tokens(step: int, rank: int, sizes) -> torch.Tensor:
    b, s = sizes[rank % len(sizes)]
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (b, s), generator=g)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def shard_rows(model, shards):
    """``{name: rows of the unsharded tensor}`` for each parameter (a slice along the experts for a sharded one)."""
    by_module = {s.module_name: s for s in shards}
    rows = {}
    for name, _ in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        shard = by_module.get(module)
        rows[name] = slice(shard.local_start, shard.local_end) if shard is not None else slice(None)
    return rows


def wrap(recipe: str, model, world: int):
    """The model under ``recipe``: ``"plain"`` (no wrapper), ``"ddp"``, ``"fsdp2"`` (the docs' recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if recipe == "ddp":
        return DDP(model)
    if recipe == "fsdp2":
        ignored = set(epmoe.expert_parameters(model)) if epmoe.ep.state.ep_model(model) is not None else set()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        return fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def full(tensor):
    """A DTensor's whole value (FSDP2's shards), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train_arms(rank, world, recipe="ddp", steps=3, sizes=((2, 12), (3, 7)), config=None, prepare=None, group=None):
    """``steps`` AdamW steps (clipped under a wrapper) of the skewed model under ``recipe``: unsharded
    (under a wrapper), EP, EP with replicas (``config`` added to ``{"replicas": 2}``); per arm the losses, step 0's logits and
    gradients, and the parameters after the steps. ``prepare(model)``: run on each arm before wrapping
    (gradient checkpointing, ...). Returns the errors of the replicas arm against each other arm."""
    base = skewed_model()
    arms, shards = {}, {}
    # without a wrapper only the expert gradients are sums over ranks: the EP arm is the reference
    for arm in ("ep", "replicas") if recipe == "plain" else ("unsharded", "ep", "replicas"):
        model = copy.deepcopy(base)
        if arm != "unsharded":
            options = with_replicas(**(config or {})) if arm == "replicas" else dict(config or {})
            shards[arm] = epmoe.apply_expert_parallel(model, group, config=options)
        if prepare is not None:
            prepare(model)
        wrapped = wrap(recipe, model, world)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        record = {"loss": [], "moves": 0}
        with recorded_plans() as plans:
            for step in range(steps):
                ids = tokens(step, rank, sizes)
                out = wrapped(ids, labels=ids)
                out.loss.backward()
                record["loss"].append(out.loss.item())
                if step == 0:
                    record["logits"] = out.logits.detach().clone()
                    record["grads"] = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
                if recipe != "plain":
                    record.setdefault("norms", []).append(epmoe.clip_grad_norm_(wrapped, 0.05).item())
                opt.step()
                opt.zero_grad(set_to_none=True)
        record["moves"] = sum(len(p) for p in plans)
        record["params"] = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        record["model"] = model
        arms[arm] = record
    out = compare_arms(arms, shards["replicas"])
    for key, arm in (("computed", "replicas"), ("computed_without", "ep")):
        out[key] = {n: t.tolist() for n, t in epmoe.expert_load(arms[arm]["model"], computed=True).items()}
    out["routed_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(
            epmoe.expert_load(arms["replicas"]["model"]).values(), epmoe.expert_load(arms["ep"]["model"]).values()
        )
    )
    return out


def compare_arms(arms, shards):
    """The replicas arm against the EP arm (same shapes) and the unsharded arm (its slice of the experts)."""
    mine, rows = arms["replicas"], shard_rows(arms["replicas"]["model"], shards)
    errors = {}
    for other in [arm for arm in ("ep", "unsharded") if arm in arms]:
        ref = arms[other]
        pick = (lambda n: slice(None)) if other == "ep" else rows.get
        errors[f"{other}/loss"] = max(abs(a - b) / abs(b) for a, b in zip(mine["loss"], ref["loss"]))
        errors[f"{other}/logits"] = rel(mine["logits"], ref["logits"])
        for key in ("grads", "params"):
            for n, t in mine[key].items():
                errors[f"{other}/{key}/{n}"] = rel(t, ref[key][n][pick(n)])
        if "norms" in mine:
            errors[f"{other}/norms"] = max(abs(a - b) / b for a, b in zip(mine["norms"], ref["norms"]))
    return {"errors": errors, "moves": mine["moves"], "plain_moves": arms["ep"]["moves"]}


def lora_arms(rank, world, steps=2):
    """LoRA on the experts (and q / v) after EP, the same peft model with and without replicas:
    every trainable gradient of step 0 and every factor after ``steps`` AdamW steps."""
    from compose_workers import lora_config
    from peft import get_peft_model

    base = skewed_model()
    arms = {}
    for arm in ("ep", "replicas"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config=with_replicas(2 if arm == "replicas" else 0))
        torch.manual_seed(0)
        peft_model = get_peft_model(model, lora_config(experts=True))
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
        with recorded_plans() as plans:
            for step in range(steps):
                ids = tokens(step, rank, ((2, 12), (3, 7)))
                peft_model(ids, labels=ids).loss.backward()
                if step == 0:
                    grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
                opt.step()
                opt.zero_grad(set_to_none=True)
        params = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        arms[arm] = {"grads": grads, "params": params, "moves": sum(len(p) for p in plans)}
    errors = {}
    for key in ("grads", "params"):
        for n, t in arms["replicas"][key].items():
            errors[f"{key}/{n}"] = rel(t, arms["ep"][key][n])
    lora = [n for n in arms["replicas"]["grads"] if "experts" in n]
    return {"errors": errors, "moves": arms["replicas"]["moves"], "expert_factors": len(lora)}


def replay_arms(rank, world):
    """Routes recorded on the EP model, the routers then moved, replayed on it with and without
    replicas: the same loss and gradients (replay fixes the routes; the plan follows them)."""
    base = skewed_model()
    models = {}
    for arm in ("ep", "replicas"):
        models[arm] = copy.deepcopy(base)
        epmoe.apply_expert_parallel(models[arm], config=with_replicas(2 if arm == "replicas" else 0))
    ids = tokens(0, rank, ((2, 12), (3, 7)))
    with epmoe.record_routing(models["ep"]) as recorded, torch.no_grad():
        models["ep"](ids)
    out = {}
    for arm, model in models.items():
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(-1.0)  # different routes unless replayed
        with recorded_plans() as plans, epmoe.replay_routing(model, recorded):
            loss = model(ids, labels=ids).loss
        loss.backward()
        out[arm] = {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        out[arm]["moves"] = sum(len(p) for p in plans)
    errors = {"loss": rel(out["replicas"]["loss"], out["ep"]["loss"])}
    for n, g in out["replicas"]["grads"].items():
        errors[f"grads/{n}"] = rel(g, out["ep"]["grads"][n])
    return {"errors": errors, "moves": out["replicas"]["moves"]}


def save_arms(rank, world, out_dir):
    """``save_pretrained`` after two training steps with replicas: the same keys and values as the
    same model trained without them (to rounding), every expert whole; the optimizer state of the
    same parameters, in the same shapes."""
    from safetensors.torch import load_file

    base = skewed_model()
    saved, states, dcp_states = {}, {}, {}
    for arm in ("ep", "replicas"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config=with_replicas(2 if arm == "replicas" else 0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            ids = tokens(step, rank, ((2, 12), (3, 7)))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        path = f"{out_dir}/{arm}"
        model.save_pretrained(path)
        dist.barrier()
        saved[arm] = load_file(f"{path}/model.safetensors")
        states[arm] = [(k, tuple(v.shape)) for st in opt.state_dict()["state"].values() for k, v in st.items()]
        dcp_states[arm] = _shapes(epmoe.get_state_dict(model, opt))
    if rank == 0:
        base.save_pretrained(f"{out_dir}/unsharded")
    dist.barrier()
    unsharded = load_file(f"{out_dir}/unsharded/model.safetensors")
    errors = {k: rel(v, saved["ep"][k]) for k, v in saved["replicas"].items()}
    return {
        "errors": errors,
        "same_keys": sorted(saved["ep"]) == sorted(saved["replicas"]),
        "same_optimizer_state": states["ep"] == states["replicas"],
        "same_dcp_state": dcp_states["ep"] == dcp_states["replicas"] and len(dcp_states["ep"]) > 0,
        "experts_whole": {k: tuple(v.shape) for k, v in saved["replicas"].items()}
        == {k: tuple(v.shape) for k, v in unsharded.items()},
    }


def _shapes(state, prefix=""):
    """``[(key path, shape)]`` of the tensors of a nested state dict (DTensors by their global shape)."""
    out = []
    for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
        if isinstance(value, dict):
            out += _shapes(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            out.append((f"{prefix}{key}", tuple(value.shape)))
    return out


def cost_model_run(rank, world):
    """The real cost model at the test model's small shapes: moving an expert costs more than its
    rows (nothing moves), and the outputs are the EP model's."""
    base = skewed_model()
    model = copy.deepcopy(base)
    plain = copy.deepcopy(base)
    epmoe.apply_expert_parallel(model, config={"replicas": 2})
    epmoe.apply_expert_parallel(plain)
    ids = tokens(0, rank, ((2, 12), (3, 7)))
    with recorded_plans() as plans:
        logits = model(ids).logits
    return {"moves": sum(len(p) for p in plans), "plans": len(plans), "logits": rel(logits, plain(ids).logits)}


def disagreement(rank, world):
    """Ranks whose configs differ in ``replicas`` (their plans would differ): every rank raises at apply."""
    try:
        epmoe.apply_expert_parallel(skewed_model(), config={"replicas": rank})
    except ValueError as exc:
        return str(exc)
    return None


def key_mismatch(rank, world):
    """Ranks whose cost models disagree (rank 0 in eval mode, the others training: their plans would
    differ): the counts exchange raises on every rank."""
    model = skewed_model()
    epmoe.apply_expert_parallel(model, config={"replicas": 2, "flops_per_link_byte": CHECKPOINT_RATE})
    model.train(rank != 0)
    try:
        model(tokens(0, rank, ((2, 12), (3, 7))))
    except ValueError as exc:
        return str(exc)
    return None


def generate_run(rank, world):
    """``generate`` (its prompt's forward with replicas, its decode steps on the static exchange)
    gives the same tokens as without replicas, and its prompt's logits."""
    base = skewed_model()
    prompt = tokens(0, rank, ((2, 9), (2, 9)))
    outs = {}
    for arm in ("ep", "replicas"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config=with_replicas(2 if arm == "replicas" else 0))
        with recorded_plans() as plans:
            sequences = model.generate(prompt, max_new_tokens=4 + rank, min_new_tokens=4 + rank, do_sample=False)
            with torch.no_grad():
                logits = model(prompt).logits
        outs[arm] = (sequences, logits, sum(len(p) for p in plans))
    return {
        "same_tokens": torch.equal(outs["ep"][0], outs["replicas"][0]),
        "logits": rel(outs["replicas"][1], outs["ep"][1]),
        "moves": outs["replicas"][2],
    }


# a rate where the test model's (fp64, H 64, I 32) forward-only cost model asks 144 slots of a move and a
# training step's 48: only a plan keyed on whether gradients will flow moves the same under every checkpointing
CHECKPOINT_RATE = 9.0


def checkpoint_kinds(rank, world, sizes=((4, 32), (4, 28))):
    """One training step of the skewed model with replicas at :data:`CHECKPOINT_RATE`: plain, and under
    ``torch.utils.checkpoint`` reentrant and not (the checkpointed forward runs without gradients
    there, or with them, and is recomputed in backward). Per kind the moves of every plan its layers
    made (forward and recompute), the telemetry's moved slots and computed rows, and the loss's and
    every gradient's errors against the plain step; and the moves of an eval forward without
    gradients (the forward-only cost model's: none at this rate), and both cost models' keys."""
    from epmoe.ep.replicas import min_rows

    base = skewed_model()
    ids = tokens(0, rank, sizes)
    out, plain = {}, None
    for kind in ("plain", "reentrant", "non_reentrant"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config={"replicas": 2, "flops_per_link_byte": CHECKPOINT_RATE})
        if kind != "plain":
            model.gradient_checkpointing_enable({"use_reentrant": kind == "reentrant"})
        model.train()
        with recorded_plans() as plans:
            loss = model(ids, labels=ids).loss
            loss.backward()
        record = {
            "loss": loss.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            "plans": [tuple(tuple(m) for m in moves) for moves in plans],
            "moved": [state.loads.moved_W for _, _, state in epmoe.ep.state.ep_states(model)],
            "computed": {n: t.tolist() for n, t in epmoe.expert_load(model, computed=True).items()},
        }
        plain = plain or record
        errors = {"loss": rel(record["loss"], plain["loss"])}
        errors.update({f"grads/{n}": rel(g, plain["grads"][n]) for n, g in record["grads"].items()})
        out[kind] = {"errors": errors, **{k: record[k] for k in ("plans", "moved", "computed")}}
        if kind == "plain":
            model.eval()
            with recorded_plans() as plans, torch.no_grad():
                model(ids)
            out["eval_plans"] = [tuple(moves) for moves in plans]
    F, H = 3 * 64 * 32, 64
    out["keys"] = [min_rows(F, H, 8, CHECKPOINT_RATE, backward) for backward in (True, False)]
    return out


def two_rank_run(rank, world, out_dir):
    """Everything the 2-rank tests ask, in one spawn."""
    results = {"module": module_cases(rank, world, SKEWED)}
    results["module_bf16"] = bf16_case(rank, world)
    for recipe in ("ddp", "fsdp2"):
        results[recipe] = train_arms(rank, world, recipe)
    results["checkpointing"] = train_arms(
        rank, world, "ddp", prepare=lambda m: m.gradient_checkpointing_enable({"use_reentrant": False})
    )
    for mode in ("sum", "mean"):
        results[f"expert_grad_{mode}"] = train_arms(rank, world, "plain", config={"expert_grad": mode})
    results["lora"] = lora_arms(rank, world)
    results["replay"] = replay_arms(rank, world)
    results["save"] = save_arms(rank, world, out_dir)
    results["checkpoint_kinds"] = checkpoint_kinds(rank, world)
    results["cost_model"] = cost_model_run(rank, world)
    results["disagreement"] = disagreement(rank, world)
    results["key_mismatch"] = key_mismatch(rank, world)
    results["generate"] = generate_run(rank, world)
    return results


def four_rank_run(rank, world):
    """EP 4 (uneven batches, a rank with none) and an EP 2 x DP 2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    cases = {
        "zipf_uneven": (2, [9, 0, 23, 14], "zipf", 1.5),
        "hot_expert_k4": (4, [11, 5, 17, 8], "one_expert", 6),
        "uniform_k2": (2, [12, 12, 12, 12], "random", None),
    }
    results = {"module": module_cases(rank, world, cases, replicas=1)}
    results["ddp"] = train_arms(rank, world, "ddp", sizes=((2, 8), (1, 11), (3, 5), (2, 6)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    results["mesh"] = train_arms(rank, world, "ddp", sizes=((2, 8), (1, 11), (3, 5), (2, 6)), group=mesh)
    return results


def bf16_case(rank, world):
    """A hot expert in bfloat16: with replicas against without, both against the float64 unsharded module."""
    model = base_model()
    ref = copy.deepcopy(experts_of(model))
    arms = {}
    for arm in ("ep", "replicas"):
        copy_ = copy.deepcopy(model).to(torch.bfloat16)
        epmoe.apply_expert_parallel(copy_, config=with_replicas(2 if arm == "replicas" else 0))
        arms[arm], _ = compare_case(
            "hot", SKEWED["hot_expert_k2"], ref, experts_of(copy_), list(range(world)), rank, torch.bfloat16, 11
        )
    return arms
