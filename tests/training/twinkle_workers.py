"""Rank functions for tests/training/test_twinkle.py: twinkle's own steps with and without epmoe.

Run in the environment with twinkle's own pins (``.venv-twinkle``: twinkle-kit 0.5.1, its peft <= 0.19),
started by ``python twinkle_workers.py OUT_DIR`` (2 gloo ranks, every case in one start). Each case
trains the same float64 Qwen3-MoE twice through twinkle's ``TransformersModel`` on its native FSDP2
strategy: unsharded (FSDP2 over both ranks, every rank holding every expert) and through
:func:`epmoe.prepare_twinkle` (EP over both ranks, experts outside FSDP2), on the same per-rank batches
(of different sizes), and returns the relative errors of what the unsharded run is the oracle for.

twinkle has no CPU platform: :func:`twinkle_on_cpu` is the patch these tests need to run it here
(its GPU platform's device and backend replaced by ``cpu`` / ``gloo``); it is test code only.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
import torch.distributed as dist

STEPS = 3
NUM_EXPERTS = 8
MESH = DP_MESH = None  # twinkle's DeviceMesh of the running case: FSDP2 over every rank, plain data parallel
BENCH_SHAPE = dict(hidden_size=256, moe_intermediate_size=128, num_experts=64, top_k=8, head_dim=32)
BENCH_TOKENS = (8, 128)  # samples per rank, tokens per sample
MAX_NORM = 0.05  # small enough that every step clips
BATCH_SIZES = (2, 3, 1, 2)  # samples per rank (the 2-rank cases take the first two)
LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "v_proj"],
    target_parameters=["experts.gate_up_proj", "experts.down_proj"],
)


def twinkle_on_cpu() -> None:
    """Tests only: twinkle picks its GPU platform without an NPU or MPS; on this CPU machine its device
    is ``cpu`` and its process-group backend ``gloo`` (its accelerate strategy's ``Accelerator`` on the CPU),
    and its own EP's count gather is flattened for gloo."""
    from twinkle.utils.platforms import gpu

    gpu.GPU.get_local_device = staticmethod(lambda idx=0, **kwargs: "cpu")
    gpu.GPU.device_backend = staticmethod(lambda platform=None: "gloo")
    gpu.GPU.device_prefix = staticmethod(lambda: "cpu")
    os.environ["ACCELERATE_USE_CPU"] = "true"  # its accelerate strategy's Accelerator: DDP on the CPU
    # twinkle's own EP gathers (W, E) counts with all_gather_into_tensor from an (E,) tensor, which gloo
    # takes only flat: its module sees a torch.distributed whose all_gather_into_tensor flattens
    from twinkle.model.transformers.moe import ep_utils

    class FlatGather:
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def all_gather_into_tensor(output, tensor, group=None, async_op=False):
            return dist.all_gather_into_tensor(output.view(-1), tensor.reshape(-1), group=group, async_op=async_op)

    ep_utils.dist = FlatGather()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if a.shape == b.shape else float("inf")


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def samples(step: int, rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 250, (BATCH_SIZES[rank], 12), generator=g)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def build(path: str, ep: str | None, lora: bool, dtype: torch.dtype = torch.float64, strategy: str = "native_fsdp"):
    """twinkle's ``TransformersModel`` on ``strategy`` (its native FSDP2 over every rank of :data:`MESH`, or
    accelerate's DDP over :data:`DP_MESH`). ``ep``: ``None`` (unsharded), ``"epmoe"``
    (:func:`epmoe.prepare_twinkle`) or ``"twinkle"`` (its own EP over every rank)."""
    from twinkle.model import TransformersModel

    import epmoe

    own_ep = {"expert_parallel": {"enabled": True, "ep_size": dist.get_world_size()}} if ep == "twinkle" else None
    model = TransformersModel(
        model_id=path,
        device_mesh=MESH if strategy == "native_fsdp" else DP_MESH,
        strategy=strategy,
        mixed_precision="no",
        torch_dtype=dtype,
        experts_implementation="eager" if dtype == torch.float64 else "grouped_mm",
        fsdp_config=own_ep,
    )
    if ep == "epmoe":
        epmoe.prepare_twinkle(model)
    if lora:
        from peft import LoraConfig

        torch.manual_seed(7)  # the same draws in both runs
        model.add_adapter_to_model("lora", LoraConfig(**LORA))
    model.set_optimizer("AdamW", lr=1e-2, **({"adapter_name": "lora"} if lora else {}))
    return model


def train(model, rank: int, adapter: str | None):
    """``STEPS`` of twinkle's forward_backward + clip_grad_and_step; the first step's gradients
    (before the clip) and each step's norm."""
    kwargs = {"adapter_name": adapter} if adapter else {}
    first_grads, norms = None, []
    for step in range(STEPS):
        model.forward_backward(inputs=samples(step, rank), **kwargs)
        if first_grads is None:
            first_grads = {n: whole(p.grad).clone() for n, p in named(model) if p.grad is not None}
        model.clip_grad_and_step(max_grad_norm=MAX_NORM, **kwargs)
        norms.append(model.optimizer_group[adapter or ""]._last_grad_norm)
    return first_grads, norms


def named(model):
    return model.strategy.unwrap_model(model.model).named_parameters()


def slice_of(name: str, full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of the unsharded tensor ``full`` that ``local`` (an EP rank's) holds: experts
    ``[rank*e, (rank+1)*e)``, in peft's layouts for the LoRA factors (lora_B expert-minor)."""
    if full.shape == local.shape:
        return full
    if "lora_B" in name:  # (out, r*E) viewed (out, r, E)
        e = NUM_EXPERTS * local.shape[1] // full.shape[1]
        return full.reshape(full.shape[0], -1, NUM_EXPERTS)[:, :, rank * e : (rank + 1) * e].reshape(full.shape[0], -1)
    return full.narrow(0, rank * local.shape[0], local.shape[0])  # experts (E, ...), lora_A (r*E, in)


def compare(ref: dict, model, rank: int) -> dict:
    errors = {}
    for name, param in named(model):
        if name in ref:
            errors[name] = rel(whole(param), slice_of(name, ref[name], whole(param), rank))
    return errors


def counts(model, adapter: str | None) -> tuple[int, int]:
    text = model.get_train_configs(**({"adapter_name": adapter} if adapter else {}))
    found = re.search(r"Trainable params: ([\d,]+) \|\| all params: ([\d,]+)", text)
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", ""))


def full_case(rank: int, path: str, out_dir: str) -> dict:
    """Full-parameter training: parameters after 3 steps, norms, the checkpoint twinkle saves."""
    from transformers import AutoModelForCausalLM

    unsharded = build(path, ep=None, lora=False)
    _, ref_norms = train(unsharded, rank, None)
    ref = {n: whole(p).detach().clone() for n, p in named(unsharded)}
    ref_counts = counts(unsharded, None)
    model = build(path, ep="epmoe", lora=False)
    _, norms = train(model, rank, None)
    errors = compare(ref, model, rank)
    saved = model.save("full", output_dir=out_dir)
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, torch_dtype=torch.float64)
    saved_errors = {n: rel(p, ref[n]) for n, p in reloaded.named_parameters() if n in ref}
    return {
        "errors": errors,
        "norms": [norms, ref_norms],
        "saved_errors": saved_errors,
        "saved_keys_missing": sorted(set(ref) - {n for n, _ in reloaded.named_parameters()}),
        "counts": [counts(model, None), ref_counts],
    }


def accelerate_case(rank: int, path: str, out_dir: str) -> dict:
    """twinkle's accelerate strategy (accelerate's DDP over both ranks) with prepare_twinkle: parameters
    after 3 steps, norms and the checkpoint twinkle saves, against the unsharded model on twinkle's
    native FSDP2 (the same averaged gradients). twinkle's own accelerate run is not the oracle: its clip
    sums the squared norms of DDP's replicated gradients over the ranks (sqrt(2) x the norm at 2 ranks)."""
    from transformers import AutoModelForCausalLM

    unsharded = build(path, ep=None, lora=False)
    _, ref_norms = train(unsharded, rank, None)
    ref = {n: whole(p).detach().clone() for n, p in named(unsharded)}
    _, twinkle_ddp_norms = train(build(path, ep=None, lora=False, strategy="accelerate"), rank, None)
    model = build(path, ep="epmoe", lora=False, strategy="accelerate")
    _, norms = train(model, rank, None)
    errors = compare(ref, model, rank)
    saved = model.save("accelerate", output_dir=out_dir)
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64)
    return {
        "errors": errors,
        "norms": [norms, ref_norms],
        "twinkle_ddp_norm_ratio": [a / b for a, b in zip(twinkle_ddp_norms, ref_norms)],
        "saved_errors": {n: rel(p, ref[n]) for n, p in reloaded.named_parameters() if n in ref},
    }


def accumulation_case(rank: int, path: str) -> dict:
    """twinkle's gradient accumulation (``gradient_accumulation_steps=2`` on every call, 5 micro-batches:
    twinkle steps where its counter says so): every parameter against the unsharded model."""

    def run(model):
        for micro in range(5):
            model.forward_backward(inputs=samples(micro, rank), gradient_accumulation_steps=2)
            model.clip_grad_and_step(max_grad_norm=MAX_NORM, gradient_accumulation_steps=2)
        return model

    unsharded = build(path, ep=None, lora=False)
    start = {n: p.detach().clone() for n, p in named(unsharded)}  # before the wrap: whole tensors
    run(unsharded)
    ref = {n: whole(p).detach().clone() for n, p in named(unsharded)}
    return {
        "errors": compare(ref, run(build(path, ep="epmoe", lora=False)), rank),
        "trained": [n for n in ref if rel(ref[n], start[n]) > 1e-6],
    }


def lora_case(rank: int, path: str, out_dir: str) -> dict:
    """LoRA on the experts and attention: the start, the first gradients, 3 steps, the adapter saved."""
    unsharded = build(path, ep=None, lora=True)
    ref_start = {n: whole(p).detach().clone() for n, p in named(unsharded) if "lora_" in n}
    ref_first, ref_norms = train(unsharded, rank, "lora")
    ref = {n: whole(p).detach().clone() for n, p in named(unsharded) if "lora_" in n}
    ref_counts = counts(unsharded, "lora")
    model = build(path, ep="epmoe", lora=True)
    start = {n: rel(whole(p), slice_of(n, ref_start[n], whole(p), rank)) for n, p in named(model) if n in ref_start}
    first, norms = train(model, rank, "lora")
    first_errors = {n: rel(g, slice_of(n, ref_first[n], g, rank)) for n, g in first.items() if n in ref_first}
    errors = compare(ref, model, rank)
    saved = model.save("adapter", output_dir=out_dir, adapter_name="lora")
    dist.barrier()
    return {
        "start": start,
        "first_grads": first_errors,
        "expert_factors": sorted(n for n in first if ".experts." in n),
        "errors": errors,
        "norms": [norms, ref_norms],
        "saved_errors": reload_adapter(path, saved, ref),
        "counts": [counts(model, "lora"), ref_counts],
    }


def reload_adapter(path: str, saved: str, trained: dict) -> dict:
    """The adapter twinkle saved, on plain transformers with peft: peft 0.19's own loader cannot convert
    into transformers 5.25 (``WeightConverter``), so its file goes into ``get_peft_model``'s model by
    name, every key of the file used and every factor of the model filled."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    peft_model = get_peft_model(base, LoraConfig.from_pretrained(saved), adapter_name="lora")
    file = {
        key.replace(".weight", ".lora.weight"): t for key, t in load_file(f"{saved}/adapter_model.safetensors").items()
    }
    factors = {name for name, _ in peft_model.named_parameters() if "lora_" in name}
    assert set(file) == factors, sorted(set(file) ^ factors)
    peft_model.load_state_dict(file, strict=False)
    return {name: rel(p, trained[name]) for name, p in peft_model.named_parameters() if "lora_" in name}


def own_ep_case(rank: int, path: str) -> dict:
    """twinkle's own EP, its per-expert loop and then epmoe's grouped matmul as its compute
    (:func:`epmoe.compose.twinkle.register_grouped_mm`): the same loss and gradients; and how its
    expert gradients compare with the unsharded model's (the caveat: summed over the EP group)."""
    from epmoe.compose.twinkle import register_grouped_mm

    def first_step(model):
        out = model.forward_backward(inputs=samples(0, rank))
        return float(out["loss"]), {n: whole(p.grad).clone() for n, p in named(model) if p.grad is not None}

    ref_loss, ref_grads = first_step(build(path, ep=None, lora=False))
    loop_loss, loop_grads = first_step(build(path, ep="twinkle", lora=False))
    register_grouped_mm()
    gmm_loss, gmm_grads = first_step(build(path, ep="twinkle", lora=False))
    experts = [n for n in gmm_grads if ".experts." in n]
    return {
        "losses": [gmm_loss, loop_loss, ref_loss],
        "gmm_vs_loop": {n: rel(gmm_grads[n], loop_grads[n]) for n in gmm_grads},
        "expert_grad_ratio": [
            float(gmm_grads[n].norm() / slice_of(n, ref_grads[n], gmm_grads[n], rank).norm()) for n in experts
        ],
        "dense_vs_unsharded": max(rel(gmm_grads[n], ref_grads[n]) for n in gmm_grads if n not in experts),
    }


def refusals(rank: int, path: str) -> dict:
    """What prepare_twinkle cannot serve, refused by name before anything changes."""
    from twinkle.model import TransformersModel

    import epmoe

    out = {}
    try:
        epmoe.prepare_twinkle(torch.nn.Linear(2, 2))
    except TypeError as exc:
        out["not_twinkle"] = str(exc)
    own_ep = TransformersModel(
        model_id=path,
        device_mesh=MESH,
        strategy="native_fsdp",
        mixed_precision="no",
        torch_dtype=torch.float64,
        experts_implementation="eager",
        fsdp_config={"expert_parallel": {"enabled": True, "ep_size": 2}},
    )
    try:
        epmoe.prepare_twinkle(own_ep)
    except ValueError as exc:
        out["own_ep"] = str(exc)
    import epmoe.compose.twinkle as prepared

    made_for, prepared.MADE_FOR = prepared.MADE_FOR, ("0.4.0",)
    try:
        epmoe.prepare_twinkle(own_ep)
    except ValueError as exc:
        out["other_version"] = str(exc)
    finally:
        prepared.MADE_FOR = made_for
    return out


def plain_peft(rank: int) -> dict:
    """peft 0.19's get_peft_model on an EP model, outside prepare_twinkle: it sizes the expert factors
    from the shard, which epmoe refuses at the first forward rather than train from another start."""
    from peft import LoraConfig, get_peft_model

    import epmoe
    from epmoe.models import build_model

    model = build_model("qwen3_moe", num_experts=NUM_EXPERTS, dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_parameters=["experts.gate_up_proj"]))
    try:
        peft_model(torch.randint(0, 250, (2, 8)))
    except ValueError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


def versions() -> dict:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("twinkle-kit", "peft", "transformers")}


def cases(rank: int, world: int, path: str, out_dir: str) -> dict:
    global MESH, DP_MESH
    twinkle_on_cpu()
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import twinkle
    from twinkle.utils import DeviceMesh

    MESH = DeviceMesh.from_sizes(world_size=world, fsdp_size=world, device_type="cpu")
    DP_MESH = DeviceMesh.from_sizes(world_size=world, dp_size=world, device_type="cpu")
    twinkle.initialize(mode="local", nproc_per_node=world, global_device_mesh=MESH, seed=0)
    results = {}
    for name, case in (
        ("full", lambda: full_case(rank, path, out_dir)),
        ("lora", lambda: lora_case(rank, path, out_dir)),
        ("accelerate", lambda: accelerate_case(rank, path, out_dir)),
        ("accumulation", lambda: accumulation_case(rank, path)),
        ("own_ep", lambda: own_ep_case(rank, path)),
        ("refusals", lambda: refusals(rank, path)),
        ("plain_peft", lambda: plain_peft(rank)),
        ("versions", versions),
    ):
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 - reported to the test
            import traceback

            results[name] = {"error": traceback.format_exc()}
    return results


def bench(rank: int, world: int, path: str, repeats: int) -> dict:
    """Not a test: the step time (forward_backward + clip_grad_and_step, float32) of twinkle's arms,
    interleaved round by round, the slowest rank's time per step; median and spread over ``repeats``."""
    global MESH
    twinkle_on_cpu()
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import time

    import twinkle
    from twinkle.kernel.ops.ep import _get_impls
    from twinkle.utils import DeviceMesh

    from epmoe.compose.twinkle import register_grouped_mm

    MESH = DeviceMesh.from_sizes(world_size=world, fsdp_size=world, device_type="cpu")
    twinkle.initialize(mode="local", nproc_per_node=world, global_device_mesh=MESH, seed=0)
    arms = {
        "twinkle FSDP2, no EP": build(path, ep=None, lora=False, dtype=torch.float32),
        "twinkle EP, its per-expert loop": build(path, ep="twinkle", lora=False, dtype=torch.float32),
        "twinkle EP, epmoe grouped_mm": build(path, ep="twinkle", lora=False, dtype=torch.float32),
        "epmoe.prepare_twinkle": build(path, ep="epmoe", lora=False, dtype=torch.float32),
    }
    register_grouped_mm()
    ours, loop_only = list(_get_impls()), [b for b in _get_impls() if b.name != "epmoe grouped_mm"]
    g = torch.Generator().manual_seed(rank)
    times = {name: [] for name in arms}
    for step in range(repeats + 1):  # the first round warms up
        inputs = [
            {"input_ids": r.tolist(), "labels": r.tolist()} for r in torch.randint(0, 250, BENCH_TOKENS, generator=g)
        ]
        for name, model in arms.items():
            _get_impls()[:] = loop_only if "loop" in name else ours
            dist.barrier()
            start = time.perf_counter()
            model.forward_backward(inputs=inputs)
            model.clip_grad_and_step(max_grad_norm=1.0)
            seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if step:
                times[name].append(float(seconds))
    return times


def write_model(path: str, dtype: torch.dtype = torch.float64, **shape) -> None:
    """A Qwen3-MoE (8 experts, top-2, unless ``shape`` says otherwise) and a word-level tokenizer, as
    twinkle loads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from epmoe.models import build_model

    vocab = {f"w{i}": i for i in range(254)} | {"<pad>": 254, "<eos>": 255}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    shape = {"num_experts": NUM_EXPERTS, **shape}
    build_model("qwen3_moe", dtype=dtype, **shape).save_pretrained(path)


def write_bench_table(results: list[dict], repeats: int, out: str) -> None:
    import statistics

    times = results[0]  # every rank holds the same maxima
    base = statistics.median(times["twinkle EP, its per-expert loop"])
    lines = [
        "# twinkle's step with and without epmoe (CPU, 2 gloo ranks, float32)",
        "",
        "Generated by `.venv-twinkle/bin/python tests/training/twinkle_workers.py --bench OUT_DIR "
        f"--repeats {repeats}` (the twinkle CPU patch lives in the tests). Qwen3-MoE {BENCH_SHAPE}, "
        f"2 layers, {BENCH_TOKENS[0]} x {BENCH_TOKENS[1]} tokens per rank; one step = twinkle's "
        "`forward_backward` + `clip_grad_and_step`, the slowest rank's time, arms interleaved round by round, "
        f"{repeats} rounds after one warm-up.",
        "",
        "| arm | step (ms), median | min - max | / twinkle EP's loop |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {1e3 * median:.1f} | {1e3 * min(values):.1f} - {1e3 * max(values):.1f} | {median / base:.2f} |"
        )
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def ep_dp_case(rank: int, world: int, path: str, out_dir: str) -> dict:
    """4 ranks, twinkle's mesh with ``ep_size=2``: EP groups of 2 ranks strided as twinkle's own
    ({0, 2}, {1, 3}), each expert on 2 ranks; 3 clipped steps against the unsharded model (FSDP2 over 4)."""
    global MESH
    twinkle_on_cpu()
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    import twinkle
    from twinkle.utils import DeviceMesh

    from epmoe.ep.state import sharded_experts

    MESH = DeviceMesh.from_sizes(world_size=world, fsdp_size=world, device_type="cpu")
    twinkle.initialize(mode="local", nproc_per_node=world, global_device_mesh=MESH, seed=0)
    try:
        unsharded = build(path, ep=None, lora=False)
        _, ref_norms = train(unsharded, rank, None)
        ref = {n: whole(p).detach().clone() for n, p in named(unsharded)}
        MESH = DeviceMesh.from_sizes(world_size=world, fsdp_size=world, ep_size=2, device_type="cpu")
        model = build(path, ep="epmoe", lora=False)
        _, norms = train(model, rank, None)
        groups = {
            tuple(dist.get_process_group_ranks(state.model.channel.group))
            for _, _, state in sharded_experts(model.strategy.unwrap_model(model.model))
        }
        errors = compare(ref, model, rank // 2)  # EP rank: groups {0, 2} and {1, 3}
        return {"errors": errors, "norms": [norms, ref_norms], "ep_groups": sorted(groups)}
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback

        return {"error": traceback.format_exc()}


def recipe(rank: int, world: int, module_dir: str, module_name: str, name: str):
    """A docs recipe marked ``env=twinkle`` (tests/project/test_readme.py), called as written."""
    import importlib

    twinkle_on_cpu()
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    sys.path.insert(0, module_dir)
    return getattr(importlib.import_module(module_name), name)(rank, world)


if __name__ == "__main__":
    import argparse

    from epmoe.launch import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--bench", action="store_true", help="time twinkle's arms instead of running the cases")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--recipe", nargs=2, metavar=("MODULE", "FUNCTION"), help="run a docs recipe instead")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ep-dp", action="store_true", help="the 4-rank EP x DP case instead")
    args = parser.parse_args()
    model_dir = os.path.join(args.out_dir, "model")
    if args.ep_dp:
        write_model(model_dir)
        results = run_ranks(ep_dp_case, 4, model_dir, args.out_dir, timeout=600)
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    elif args.recipe:  # the recipe's default checkpoint folder, under the working directory
        write_model("qwen3-moe", torch.float32)
        results = run_ranks(recipe, args.ranks, args.out_dir, *args.recipe, timeout=600)
        with open(os.path.join(args.out_dir, "recipe.json"), "w") as f:
            json.dump(results, f)
    elif args.bench:
        write_model(model_dir, torch.float32, **BENCH_SHAPE)
        results = run_ranks(bench, 2, model_dir, args.repeats, timeout=1800)
        write_bench_table(results, args.repeats, os.path.join(args.out_dir, "twinkle_cpu.md"))
    else:
        write_model(model_dir)
        results = run_ranks(cases, 2, model_dir, args.out_dir, timeout=600)
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f)
