"""``epmoe bench versus``: epmoe against transformers' own expert parallelism, side by side.

transformers ships its own EP: ``from_pretrained(path, distributed_config=DistributedConfig(ep_size=W,
fsdp_size=W))`` shards the experts ``Shard(0)`` over an ``"ep"`` mesh, wraps the rest in FSDP2, and
exchanges tokens with ``AllToAllEP`` (one row per (token, expert) pair, split sizes read to the host
every layer, routing weights applied on the sender). epmoe runs the same saved checkpoint with
``apply_expert_parallel`` and its FSDP2 recipe (the dense part ``fully_shard``-ed per decoder layer and
at the root, the experts left out: ``ignored_params``), as it runs on accelerators (``check_steps``
off; its CPU default adds a step-header exchange to each layer's backward, on a line of its own). A
third system sits between them: transformers' own EP with epmoe's token exchange and routed MLP
(``DistributedConfig(ep_implementation="epmoe")``, registered by ``import epmoe``), everything else
transformers' (its FSDP2, its checkpoints). All on ``W`` gloo ranks of this machine, each rank its
own batch, the same batches for all, every figure measured in the same run:

- **exactness**: each system against the unsharded model (the same checkpoint on every rank, the
  gradients averaged over the ranks' batches as data parallelism does), float64 with transformers'
  ``eager`` experts: the ranks' batches of different lengths, 5 AdamW steps, the largest relative
  difference (to the largest entry of the reference) of any rank's loss and of any parameter's
  gradient (experts gathered, FSDP shards gathered) over the steps, and the parameter where it is.
  *Exact* is within ``EXACT`` (1e-10).
- **step time**: forward, backward and the AdamW step, float32 (transformers' experts on
  ``grouped_mm``), the median over interleaved rounds of the slowest rank's time.
- **peak memory** of that step per rank: the most bytes the CPU allocator held at once during the
  step above what it held before (``torch.profiler``'s allocation records), the median of interleaved
  rounds (it moves with when a finished collective's buffers are freed), the largest rank's.
- **per MoE layer**, one experts module alone (the first layer's), forward and backward on the same
  random routing of ``T`` tokens per rank: the bytes autograd saves for backward (unique storages,
  parameters and the module's input excluded), the bytes each rank hands to other ranks (every
  all-to-all's payload less what stays on the rank, read from the ``c10d`` ops ``torch.profiler``
  records: transformers' functional collectives and epmoe's ops reach the same ones), the host reads
  (``Tensor.item / tolist / cpu ...`` calls) and the collectives; and the host reads and collectives
  of a decode-sized inference call (``DECODE_TOKENS`` tokens per rank, no gradient); and the host
  reads of one whole inference forward of the model at that size (every MoE layer: epmoe inside
  transformers reads its route headers at the first one only).
  epmoe's line is ``dispatch="auto"`` (all-to-all-v; its static exchange runs inside its ``generate``,
  not in a bare inference call); two more lines give ``dispatch="static"`` and ``check_steps`` on.
  epmoe inside transformers runs ``check_steps`` off too (registered with that config in the
  benchmark's ranks, as on accelerators).
- **decode**: greedy ``generate`` of ``NEW_TOKENS`` tokens from an 8-token prompt at batch 1 and 8
  per rank (different prompts per rank), ms per token, the slowest rank's: transformers' EP model as
  loaded (FSDP2 included: it has no other form), epmoe's EP model without FSDP (what one runs for
  inference), and the model without EP on every rank.
- **shared batch** (``DistributedConfig(ep_size=W, tp_size=W, fsdp_size=1)``: every rank of the EP
  group holds the same batch), on the same model with 4 key-value heads (a TP mesh of 4 splits them;
  the other figures keep 2: with 4, Mixtral at EP 4 in float64 drifts from the unsharded model in its
  attention weights' gradients, exact at the first step, 7e-10 at the second, 2e-7 by the fifth: AdamW's
  normalised update magnifies rounding-level differences of the MoE output's gradient): the two systems built on
  transformers' EP, the step as above (its
  ``"auto"`` runs ``all_to_all`` there, each TP rank's slice of the batch) and greedy ``generate`` as
  above, the same prompts on every rank (its ``"auto"`` runs ``all_reduce`` at inference; epmoe's
  shared-batch transport in both).
- **features**: what each system offers across the lifecycle. Checked in this run: ``save_pretrained``
  on every rank then plain ``from_pretrained`` of the files (logits against the unsharded model's);
  PEFT LoRA on every expert tensor (``target_parameters``), 3 AdamW steps, fp64, the logits against the
  unsharded peft model's; ``torch.compile`` forward and backward, fp64, the loss; transformers' Trainer
  with checkpoints on a model sharded at load. The other cells name where they are shown.

Ratios are over transformers' own (``"auto"``, its ``all_to_all`` where the ranks hold different
batches): below 1 is the other system ahead.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import statistics
import tempfile
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import epmoe
from epmoe.bench import common
from epmoe.bench.static import counting, peak_bytes
from epmoe.integrations import transformers_ep
from epmoe.launch import run_ranks
from epmoe.models import build_model
from epmoe.training.fsdp import shard_dense

EXACT = 1e-10
# the comparison's precisions, and the largest relative difference each calls exact: float64 the
# arithmetic's own exactness, float32 its rounding after 5 AdamW steps (AdamW's normalised update
# lifts the rounding of near-zero gradients: 2e-5 to 4e-4 measured for either system)
PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32}
TOLERANCE = {"fp64": EXACT, "fp32": 1e-3}
STEPS = 5
NEW_TOKENS = 8
PROMPT = 8
DECODE_TOKENS = 8  # tokens per rank of the decode-sized MoE layer call
DECODE_BATCHES = (1, 8)
# family: (experts, top-k, expert width key); top-k as the family's real models choose (Qwen3-MoE and
# DeepSeek-V3 top-8, Mixtral top-2, GPT-OSS top-4)
FAMILIES = {
    "qwen3_moe": (16, 8, "moe_intermediate_size"),
    "mixtral": (8, 2, "intermediate_size"),
    "deepseek_v3": (16, 8, "moe_intermediate_size"),
    "gpt_oss": (16, 4, "intermediate_size"),
}
QUICK_FAMILIES = ("qwen3_moe",)
# epmoe as it runs on accelerators: its CPU default (check_steps on) adds a step-header exchange to each
# layer's backward, one collective and one host read, shown on a line of its own
EPMOE = {"check_steps": False}
STATIC = {"dispatch": "static"}
# the systems of every figure: epmoe's EP model; transformers' own EP with epmoe's token exchange
# (DistributedConfig(ep_implementation="epmoe")); transformers' own EP as it ships
SYSTEMS = ("epmoe", "in transformers", "transformers")
IN_TRANSFORMERS = "epmoe"  # the ep_implementation the middle system loads with


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    hidden: int
    intermediate: int
    tokens: int  # per rank, for the step and the MoE layer (2 rows of tokens // 2)
    worlds: tuple[int, ...]
    families: tuple[str, ...]


PLAN = Plan(hidden=256, intermediate=128, tokens=128, worlds=(2, 4), families=tuple(FAMILIES))
QUICK_PLAN = Plan(hidden=64, intermediate=32, tokens=32, worlds=(2,), families=QUICK_FAMILIES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family",
        action="append",
        choices=list(FAMILIES),
        help="run only this family (repeatable; default: all, --quick: qwen3_moe)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError:
        raise ValueError(
            "epmoe bench versus needs transformers >= 5.24 (its DistributedConfig(ep_size=...)); "
            "pip install 'epmoe[models]'"
        ) from None
    settings = common.configure(args)
    if settings.device.type != "cpu":
        raise ValueError(
            f"epmoe bench versus(--device): {settings.device} given; it runs both systems on gloo ranks "
            "of this machine's CPU only"
        )
    plan = QUICK_PLAN if settings.quick else PLAN
    if args.family:
        plan = Plan(plan.hidden, plan.intermediate, plan.tokens, plan.worlds, tuple(args.family))
    report = run_versus(plan, settings)
    print(report.markdown())
    if settings.out:
        with open(settings.out, "w") as out:
            out.write(report.document(settings))
        print(f"\nwrote {settings.out}")
    return 0


def model_of(family: str, plan: Plan, dtype: torch.dtype = torch.float32, kv_heads: int = 2) -> torch.nn.Module:
    """``family``'s model at the plan's sizes, with ``kv_heads`` key-value heads (4 for the
    shared-batch figures: a TP mesh of up to four ranks splits them)."""
    experts, top_k, width = FAMILIES[family]
    sizes = {"hidden_size": plan.hidden, width: plan.intermediate, "num_key_value_heads": kv_heads}
    return build_model(family, num_experts=experts, top_k=top_k, dtype=dtype, **sizes)


def tp_path(path: str) -> str:
    """Where :func:`run_versus` saves the family's model with 4 key-value heads, beside ``path``."""
    return f"{path}/tp"


def run_versus(plan: Plan, settings: common.Settings) -> VersusReport:
    """Save each family's model, then run every figure on ``W`` spawned ranks for each ``W``."""
    report = VersusReport(plan, settings)
    for family in plan.families:
        with tempfile.TemporaryDirectory(prefix="epmoe-versus-") as path:
            model_of(family, plan).save_pretrained(path)
            model_of(family, plan, kv_heads=4).save_pretrained(tp_path(path))
            for world in plan.worlds:
                threads = max(1, settings.threads // world)
                report.runs[family, world] = run_ranks(
                    _rank,
                    world,
                    path,
                    family,
                    plan,
                    settings.warmup,
                    settings.repeats,
                    settings.seed,
                    threads_per_rank=threads,
                    timeout=1800,
                )[0]
    return report


# ---------------------------------------------------------------------------------------------
# One rank


def _rank(rank: int, world: int, path: str, family: str, plan: Plan, warmup: int, repeats: int, seed: int) -> dict:
    """Every figure of ``family`` at EP ``world``, this rank's share; rank 0's result carries the
    figures reduced over the ranks."""
    transformers_ep.register(IN_TRANSFORMERS, EPMOE)  # as on accelerators, like epmoe's own line
    out = {"exact": {bits: _exactness(rank, world, path, seed, dtype) for bits, dtype in PRECISIONS.items()}}
    models = {
        "epmoe": _epmoe_fsdp(_load(path), world),
        "in transformers": _load(path, world, implementation=IN_TRANSFORMERS),
        "transformers": _load(path, world),
    }
    # the step first: FSDP2 initialises at a root forward, before any experts module runs alone
    out["step"], out["peak"] = _step_figures(models, plan, rank, warmup, repeats, seed)
    out["moe layers"] = sum(name.endswith("mlp.experts") for name, _ in models["transformers"].named_modules())
    out["forward reads"] = {name: _forward_reads(model, rank, seed) for name, model in models.items()}
    out["layer"] = {
        name: _layer_figures(model, plan, rank, seed)
        for name, model in (
            *models.items(),
            ("epmoe static", _epmoe(path, **STATIC)),
            ("epmoe checked", _epmoe(path, check_steps=True)),
        )
    }
    del models["epmoe"]
    out["decode"] = _decode_figures(path, models, rank, warmup, repeats, seed)
    del models  # trained by the step figures: the round trips and checks load their own
    out["shared"] = _shared_batch_figures(tp_path(path), world, plan, warmup, repeats, seed)
    out["saved"] = _save_round_trips(path, world, rank)
    out["checked"] = {
        "lora": _checked(_lora_steps, path, world, rank, seed),
        "compile": _checked(_compiled_step, path, world, rank, seed),
        "trainer checkpoints": _trainer_checkpoints(path, world),
    }
    return out


def _load(
    path: str,
    ep_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    experts: str = "grouped_mm",
    implementation: str = "auto",
    shared_batch: bool = False,
) -> torch.nn.Module:
    """The saved model; with ``ep_size``, through transformers' own EP (``fsdp_size`` the world), its
    tokens exchanged by ``implementation`` (``"auto"``: its ``all_to_all`` here, where the ranks hold
    different batches; ``"epmoe"``: epmoe's, registered by ``import epmoe``); ``shared_batch``: a TP
    mesh of ``ep_size`` ranks instead of FSDP (``tp_size=ep_size, fsdp_size=1``)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    meshes = {"tp_size": ep_size, "fsdp_size": 1} if shared_batch else {"fsdp_size": ep_size}
    config = DistributedConfig(ep_size=ep_size, ep_implementation=implementation, **meshes)
    kwargs = {"distributed_config": config} if ep_size else {}
    experts = experts if dtype != torch.float64 else "eager"  # grouped_mm takes no float64
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation=experts, **kwargs)


def _epmoe_fsdp(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """epmoe's FSDP2 recipe: EP over the world, the rest sharded per decoder layer and at the root."""
    from torch.distributed.device_mesh import init_device_mesh

    epmoe.apply_expert_parallel(model, config=EPMOE)
    return shard_dense(model, init_device_mesh("cpu", (world,)))


def _epmoe(path: str, dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    """epmoe's EP model without FSDP (what it runs for inference), ``options`` over :data:`EPMOE`."""
    model = _load(path, dtype=dtype)
    epmoe.apply_expert_parallel(model, config={**EPMOE, **options})
    return model


def _batch(vocab: int, rank: int, step: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed + 7919 * rank + step))


# exactness -------------------------------------------------------------------------------------


def _exactness(rank: int, world: int, path: str, seed: int, dtype: torch.dtype) -> dict:
    """``{system: {"loss": ..., "grads": ...} or {"error": ...}}``: the largest relative differences
    from the unsharded model over :data:`STEPS` AdamW steps in ``dtype``, the largest rank's."""
    ref = _train(_load(path, dtype=dtype), rank, seed, reduce=True)
    out = {}
    for name, build in (
        ("epmoe", lambda: _epmoe_fsdp(_load(path, dtype=dtype), world)),
        ("in transformers", lambda: _load(path, world, dtype=dtype, implementation=IN_TRANSFORMERS)),
        ("transformers", lambda: _load(path, world, dtype=dtype)),
    ):
        try:
            got = _train(build(), rank, seed, reduce=False)
            grads = [
                (_rel(step[p], ref_step[p]), p) for step, ref_step in zip(got["grads"], ref["grads"]) for p in ref_step
            ]
            out[name] = {
                "loss": max(map(_rel, got["loss"], ref["loss"])),
                "grads": max(grads)[0],
                "worst": max(grads)[1],
            }
        except Exception:  # noqa: BLE001 - reported in the table with its error, the other system still runs
            out[name] = {"error": traceback.format_exc().strip().splitlines()[-1]}
    every = [None] * world
    dist.all_gather_object(every, out)
    return {
        name: (
            {"error": next(r[name]["error"] for r in every if "error" in r[name])}
            if any("error" in r[name] for r in every)
            else {
                "loss": max(r[name]["loss"] for r in every),
                **max(
                    ({"grads": r[name]["grads"], "worst": r[name]["worst"]} for r in every), key=lambda g: g["grads"]
                ),
            }
        )
        for name in out
    }


def _train(model: torch.nn.Module, rank: int, seed: int, reduce: bool) -> dict:
    """:data:`STEPS` AdamW steps on this rank's batches (``2 x (12 + 4 rank)`` tokens): ``{"loss":
    [loss per step], "grads": [{name: full gradient} per step]}``; ``reduce``: the unsharded model,
    its gradients averaged over the ranks here."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(STEPS):
        ids = _batch(model.config.vocab_size, rank, step, 12 + 4 * rank, seed)
        loss = model(ids, labels=ids).loss
        loss.backward()
        if reduce:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        losses.append(loss.detach().reshape(1))
        grads.append({name: _full_grad(p) for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {"loss": losses, "grads": grads}


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient over the whole parameter: a DTensor's gathered, an epmoe expert shard's
    gathered over its EP group."""
    grad = p.grad if p.grad is not None else torch.zeros_like(p)
    if hasattr(grad, "full_tensor"):
        return grad.full_tensor()
    if epmoe.is_expert_parameter(p):
        group = epmoe.ep_model(p).group
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, grad.contiguous(), group=group)
        return torch.cat(parts)
    return grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


# per MoE layer ---------------------------------------------------------------------------------


# bytes per element of the dtype names torch.profiler records
ITEMSIZE = {
    "float": 4,
    "double": 8,
    "long int": 8,
    "long": 8,
    "int": 4,
    "short": 2,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
}


def _collectives(fn) -> tuple[int, int]:
    """``(collectives, bytes to other ranks)`` of ``fn()``: every ``c10d`` op ``torch.profiler``
    records in it (what ``dist.*``, the functional collectives and epmoe's ops all reach), an
    all-to-all's payload being its input rows less the ones that stay on this rank, read from the
    op's recorded shapes and split sizes (the EP group is the world in this benchmark)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    ops = [e for e in prof.events() if e.name.startswith("c10d::")]
    return len(ops), sum(_sent_to_peers(e, dist.get_rank(), dist.get_world_size()) for e in ops)


def _sent_to_peers(event, rank: int, size: int) -> int:
    if event.name != "c10d::alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        if event.name.startswith("c10d::alltoall"):
            raise NotImplementedError(f"{event.name}: only all_to_all_single's payload is read here")
        return 0
    recorded = event.concrete_inputs[4]
    if not isinstance(recorded, list):
        raise RuntimeError(f"{event.name}: torch.profiler recorded no split sizes ({recorded!r})")
    shape, splits = event.input_shapes[1], recorded or [event.input_shapes[1][0] // size] * size
    row = math.prod(shape[1:]) * ITEMSIZE[event.input_dtypes[1]]
    return (sum(splits) - splits[rank]) * row


def _layer_figures(model: torch.nn.Module, plan: Plan, rank: int, seed: int) -> dict:
    """One experts module (the first MoE layer's) alone: forward and backward on random routing of
    ``plan.tokens`` tokens: saved bytes, bytes to peers, host reads, collectives."""
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))
    E, K = _experts_and_top_k(model.config)
    g = torch.Generator().manual_seed(seed + 31 * rank)
    T = plan.tokens
    x = torch.randn(T, plan.hidden, generator=g)
    index = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=-1)

    def call(hooks=None):
        x_leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
        with hooks or contextlib.nullcontext():
            out = experts(x_leaf, index, w_leaf)
        out.square().sum().backward()
        return x_leaf

    def decode_sized():  # inference, as a decode step calls it: no gradient, DECODE_TOKENS tokens
        with torch.no_grad():
            experts(x[:DECODE_TOKENS], index[:DECODE_TOKENS], weights[:DECODE_TOKENS])

    for first in (call, decode_sized):  # first calls agree buffers, log, warm caches
        first()
    with counting() as counts:
        call()
    with counting() as inference:
        decode_sized()
    collectives, wire = _collectives(call)
    return {
        "saved": _saved_bytes(model, call),
        "wire": wire,
        "reads": counts["reads"],
        "collectives": collectives,
        "inference": (inference["reads"], _collectives(decode_sized)[0]),
    }


def _forward_reads(model: torch.nn.Module, rank: int, seed: int) -> int:
    """Host reads of one whole inference forward (no gradient, ``DECODE_TOKENS`` tokens), the
    second: the first agrees buffers and warms caches."""
    ids = _batch(model.config.vocab_size, rank, 500, DECODE_TOKENS, seed)[:1]
    with torch.no_grad():
        model(ids)
        with counting() as counts:
            model(ids)
    return counts["reads"]


def _experts_and_top_k(config) -> tuple[int, int]:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return getattr(config, key), config.num_experts_per_tok
    raise ValueError(f"no expert count in {type(config).__name__}")


def _saved_bytes(model: torch.nn.Module, call) -> int:
    """Bytes of the unique storages autograd saves in ``call``'s forward, the call's input and the
    weights excluded: the parameters as they are while the forward runs (FSDP2's unsharded copies,
    the local tensors transformers' EP swaps in), looked up when each tensor is saved."""
    saved: dict[int, int] = {}

    def weights() -> set[int]:
        found = set()
        for module in model.modules():
            tensors = [*module._parameters.values(), *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
            for t in tensors:
                if t is not None:
                    found.add((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr())
        return found

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in weights():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x_leaf = call(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    saved.pop(x_leaf.untyped_storage().data_ptr(), None)
    return sum(saved.values())


# the step and decode ---------------------------------------------------------------------------


def _step_figures(
    models: dict[str, torch.nn.Module], plan: Plan, rank: int, warmup: int, repeats: int, seed: int
) -> tuple[dict, dict]:
    """``({system: seconds per round}, {system: peak bytes, the largest rank's})`` of forward,
    backward and an AdamW step, interleaved round by round."""
    ids = _batch(models["epmoe"].config.vocab_size, rank, 100, plan.tokens // 2, seed)
    steps = {name: _train_step(model, ids) for name, model in models.items()}
    for step in [*steps.values()] * 2:  # the optimizers' state and FSDP's buffers exist before any peak
        step()
    # the peak moves from round to round (when a finished collective's buffers are freed): the median
    # of interleaved rounds
    rounds = [{name: peak_bytes(step) for name, step in steps.items()} for _ in range(max(repeats, 3))]
    peaks = {name: statistics.median(r[name] for r in rounds) for name in steps}
    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, peaks)
    return (
        {name: list(t.samples_s) for name, t in timings.items()},
        {name: max(r[name] for r in every) for name in peaks},
    )


def _train_step(model: torch.nn.Module, ids: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _decode_figures(
    path: str, loaded: dict[str, torch.nn.Module], rank: int, warmup: int, repeats: int, seed: int
) -> dict:
    """``{batch: {system: seconds per token per round (the slowest rank's)}}`` of greedy ``generate``;
    ``loaded``: the systems transformers loaded (as loaded: FSDP2 included)."""
    plain = _load(path)
    models = {"epmoe": _epmoe(path), **loaded, "without EP": plain}
    out = {}
    for batch in DECODE_BATCHES:
        prompt = torch.randint(
            0,
            plain.config.vocab_size,
            (batch, PROMPT),
            generator=torch.Generator().manual_seed(seed + 97 * rank + batch),
        )
        steps = {name: (lambda m=m: _generate(m, prompt)) for name, m in models.items()}
        timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
        out[batch] = {name: [s / NEW_TOKENS for s in t.samples_s] for name, t in timings.items()}
    return out


def _shared_batch_figures(path: str, world: int, plan: Plan, warmup: int, repeats: int, seed: int) -> dict:
    """``{"step": {system: seconds per round}, "decode": {batch: {system: seconds per token}}}`` of
    the systems on transformers' EP with a TP mesh that is the EP group (every rank the same batch),
    or ``{"error": ...}`` where transformers cannot load the model so."""
    try:
        models = {
            "in transformers": _load(path, world, implementation=IN_TRANSFORMERS, shared_batch=True),
            "transformers": _load(path, world, shared_batch=True),
        }
    except Exception:  # noqa: BLE001 - the table says what failed
        return {"error": traceback.format_exc().strip().splitlines()[-1][:160]}
    vocab = models["transformers"].config.vocab_size
    steps = {name: _train_step(model, _batch(vocab, 0, 100, plan.tokens // 2, seed)) for name, model in models.items()}
    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
    out = {"step": {name: list(t.samples_s) for name, t in timings.items()}, "decode": {}}
    for batch in DECODE_BATCHES:
        prompt = torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(seed + batch))
        decodes = {name: (lambda m=m: _generate(m, prompt)) for name, m in models.items()}
        timings = common.measure(decodes, warmup=warmup, repeats=repeats, ranks=True)
        out["decode"][batch] = {name: [s / NEW_TOKENS for s in t.samples_s] for name, t in timings.items()}
    return out


def _generate(model: torch.nn.Module, prompt: torch.Tensor) -> None:
    with torch.no_grad():
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )


def _save_round_trips(path: str, world: int, rank: int) -> dict:
    """``{system: largest relative logits difference of the reloaded model, or its error}``:
    ``save_pretrained`` on every rank, then plain ``from_pretrained`` of the files on rank 0."""
    out = {}
    ref = _load(path)
    ids = _batch(ref.config.vocab_size, 0, 200, 16, 0)
    for name, model in (
        ("epmoe", _epmoe(path)),
        ("in transformers", _load(path, world, implementation=IN_TRANSFORMERS)),
        ("transformers", _load(path, world)),
    ):
        with tempfile.TemporaryDirectory(prefix="epmoe-versus-save-") as saved:
            every = [saved] * world
            dist.broadcast_object_list(every, src=0)  # rank 0's directory on every rank
            try:
                model.save_pretrained(every[0])
                dist.barrier()
                if rank == 0:
                    with torch.no_grad():
                        out[name] = _rel(_load(every[0])(ids).logits, ref(ids).logits)
            except Exception:  # noqa: BLE001 - the table says what failed
                out[name] = "error: " + traceback.format_exc().strip().splitlines()[-1][:160]
            dist.barrier()
    return out


# features checked in this run ------------------------------------------------------------------


def _checked(check, path: str, world: int, rank: int, seed: int) -> dict:
    """``{system: largest relative difference from the unsharded model, over the ranks, or the
    error}`` of ``check(model, rank, seed, reduce)`` on the unsharded model (``reduce``: its gradients
    averaged over the ranks) and on each system's EP model."""
    ref = check(_load(path, dtype=torch.float64), rank, seed, True)
    out = {}
    # epmoe's expert gradients averaged over the ranks like the reference's (its default without a
    # data-parallel wrapper sums them: the unsharded model on the ranks' batches concatenated)
    for name, build in (
        ("epmoe", lambda: _epmoe(path, torch.float64, expert_grad="mean")),
        ("in transformers", lambda: _load(path, world, dtype=torch.float64, implementation=IN_TRANSFORMERS)),
        ("transformers", lambda: _load(path, world, dtype=torch.float64)),
    ):
        try:
            out[name] = _rel(check(build(), rank, seed, False), ref)
        except Exception:  # noqa: BLE001 - the table says what failed
            out[name] = "error: " + traceback.format_exc().strip().splitlines()[-1][:200]
    every = [None] * world
    dist.all_gather_object(every, out)
    return {
        name: next((r[name] for r in every if isinstance(r[name], str)), None) or max(r[name] for r in every)
        for name in out
    }


def _lora_steps(model: torch.nn.Module, rank: int, seed: int, reduce: bool) -> torch.Tensor:
    """PEFT LoRA on every expert tensor (``target_parameters``, random A and B), 3 AdamW steps on this
    rank's batches: the logits on a batch every rank shares."""
    from peft import LoraConfig, get_peft_model

    targets = sorted(
        {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if ".mlp.experts." in name and p.dim() == 3}
    )
    torch.manual_seed(seed)  # the same factors on every rank and in both systems
    model = get_peft_model(
        model,
        LoraConfig(
            r=2,
            lora_alpha=4,
            init_lora_weights=False,
            target_modules=[],
            target_parameters=[f"mlp.experts.{t}" for t in targets],
        ),
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    for step in range(3):
        ids = _batch(model.config.vocab_size, rank, step, 12 + 4 * rank, seed)
        model(ids, labels=ids).loss.backward()
        if reduce:
            for p in trained:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return model(_batch(model.config.vocab_size, 0, 300, 16, seed)).logits


def _compiled_step(model: torch.nn.Module, rank: int, seed: int, reduce: bool) -> torch.Tensor:
    """``torch.compile(model)``: this rank's loss, forward and backward run."""
    ids = _batch(model.config.vocab_size, rank, 400, 16, seed)
    loss = torch.compile(model)(ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _trainer_checkpoints(path: str, world: int) -> str:
    """What ``transformers.Trainer`` says to checkpoints (``save_strategy="steps"``, the default) of a
    model transformers' own EP sharded at load."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory(prefix="epmoe-versus-trainer-") as out:
        try:
            Trainer(
                model=_load(path, world),
                args=TrainingArguments(output_dir=out, save_strategy="steps", report_to=[], use_cpu=True),
            )
            return "takes them"
        except ValueError as exc:
            return f"refused: {exc}"


def ep_plans() -> set[str]:
    """The model directories of transformers holding a config with a ``base_model_ep_plan`` (what
    ``DistributedConfig(ep_size=...)`` needs to shard a model's experts)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = set()
    for model_type in CONFIG_MAPPING.keys():
        try:
            config = CONFIG_MAPPING[model_type]
        except (ImportError, KeyError, AttributeError):  # a config whose dependencies are missing
            continue
        if getattr(config, "base_model_ep_plan", None):
            found.add(config.__module__.split(".")[2])
    return found


# the report ------------------------------------------------------------------------------------


@dataclass
class VersusReport:
    plan: Plan
    settings: common.Settings
    runs: dict = field(default_factory=dict)  # (family, world) -> rank 0's result

    def lines(self, family: str, world: int) -> list[tuple]:
        """``(figure, *one cell per system, *each system's ratio to transformers')`` rows of one run
        (:data:`SYSTEMS` order; transformers' own ratio left out)."""
        r = self.runs[family, world]
        rows = []
        for bits, tolerance in TOLERANCE.items():
            label = f"exact vs the unsharded model ({STEPS} AdamW steps, {bits}, <= {tolerance:.0e})"
            rows.append((label, *(_exact_cell(r["exact"][bits][name], tolerance) for name in SYSTEMS), "", ""))
        step = {name: statistics.median(samples) for name, samples in r["step"].items()}
        rows.append(("step time ms (fwd + bwd + AdamW)", *_cells(step, 1e3, "{:.1f}"), *_ratios(step)))
        rows.append(("peak memory per rank MiB (step)", *_cells(r["peak"], 2**-20, "{:.1f}"), *_ratios(r["peak"])))
        layer = r["layer"]
        for key, label, scale, fmt in (
            ("saved", "saved activations per MoE layer KiB", 2**-10, "{:.1f}"),
            ("wire", "bytes to peers per MoE layer KiB (fwd + bwd)", 2**-10, "{:.1f}"),
            ("reads", "host reads per MoE layer (fwd + bwd)", 1, "{:.0f}"),
            ("collectives", "collectives per MoE layer (fwd + bwd)", 1, "{:.0f}"),
        ):
            values = {name: layer[name][key] for name in SYSTEMS}
            rows.append((label, *_cells(values, scale, fmt), *_ratios(values)))
        inference = ["{} / {}".format(*layer[name]["inference"]) for name in SYSTEMS]
        rows.append(
            (f"host reads / collectives per MoE layer at inference ({DECODE_TOKENS} tokens)", *inference, "", "")
        )
        layers = r["moe layers"]
        reads = r["forward reads"]
        label = f"host reads per inference forward ({layers} MoE layer{'s' * (layers > 1)}, {DECODE_TOKENS} tokens)"
        rows.append((label, *_cells(reads, 1, "{:.0f}"), "", ""))
        theirs = f"{layer['transformers']['reads']} / {layer['transformers']['collectives']}"
        for variant, label in (
            ("epmoe static", 'epmoe dispatch="static"'),
            ("epmoe checked", "epmoe check_steps=True (its CPU default)"),
        ):
            mine = f"{layer[variant]['reads']} / {layer[variant]['collectives']}"
            rows.append((f"host reads / collectives per MoE layer, {label}", mine, "", theirs, "", ""))
        for batch, by_system in r["decode"].items():
            ms = {name: 1e3 * statistics.median(samples) for name, samples in by_system.items()}
            label = f"decode batch {batch} ms/token (without EP: {ms['without EP']:.1f})"
            rows.append((label, *_cells(ms, 1, "{:.1f}"), *_ratios(ms)))
        rows.extend(_shared_batch_rows(r["shared"], world))
        saved = {name: (v if isinstance(v, str) else f"reloads, logits {v:.1e}") for name, v in r["saved"].items()}
        rows.append(("save_pretrained on every rank, plain reload (this run)", *(saved[n] for n in SYSTEMS), "", ""))
        return rows

    def features(self) -> list[tuple[str, ...]]:
        """``(feature, *one cell per system)`` rows: what this run checked, and where the rest is shown
        (the middle system is transformers' own EP with epmoe's exchange: transformers' machinery
        around it)."""
        checked = {
            key: {name: _cell(value) for name, value in by_system.items()}
            for key, by_system in next(iter(self.runs.values()))["checked"].items()
            if key != "trainer checkpoints"
        }
        exact = {
            name: [
                f"{family} EP {world} {bits}"
                for (family, world), r in self.runs.items()
                for bits, tolerance in TOLERANCE.items()
                if "error" in r["exact"][bits][name]
                or max(r["exact"][bits][name]["loss"], r["exact"][bits][name]["grads"]) > tolerance
            ]
            for name in SYSTEMS
        }
        refusal = next(iter(self.runs.values()))["checked"]["trainer checkpoints"]
        first = "{} EP {}".format(*next(iter(self.runs)))  # the checks run in every run; the first's are shown
        return [
            (
                "families",
                "every MoE family transformers ships, exact or refused by name (the families table, docs/models.md)",
                "the families of transformers' EP plans whose experts epmoe runs; any other refused at load by name",
                f"{len(ep_plans())} model directories whose config has a `base_model_ep_plan` (the table's last column)",
            ),
            (
                f"exact vs the unsharded model (this run: {len(self.runs)} runs above)",
                *(
                    f"not exact, or failed, in {', '.join(runs)}" if runs else "exact in every run"
                    for runs in exact.values()
                ),
            ),
            (
                f"PEFT LoRA on the experts, 3 AdamW steps, logits vs the unsharded peft model (this run: {first}, fp64)",
                *(checked["lora"][name] for name in SYSTEMS),
            ),
            (
                f"`torch.compile`, forward + backward, loss vs the unsharded model (this run: {first}, fp64)",
                *(checked["compile"][name] for name in SYSTEMS),
            ),
            *_documented_features(first, refusal),
        ]

    def markdown(self) -> str:
        sections = []
        for family, world in self.runs:
            rows = self.lines(family, world)
            sections.append(
                f"### {family}, EP {world}\n\n"
                + common.markdown_table(
                    (
                        "figure",
                        "epmoe",
                        f"transformers + ep_implementation={IN_TRANSFORMERS}",
                        "transformers",
                        "epmoe / transformers",
                        "transformers + epmoe / transformers",
                    ),
                    rows,
                )
            )
        sections.append(
            "### Features\n\n"
            + common.markdown_table(
                (
                    "feature",
                    "epmoe",
                    f"transformers + ep_implementation={IN_TRANSFORMERS}",
                    "transformers `DistributedConfig(ep_size=...)`",
                ),
                self.features(),
            )
        )
        return "\n\n".join(sections)

    def document(self, settings: common.Settings) -> str:
        import transformers

        plan = self.plan
        default = (QUICK_PLAN if settings.quick else PLAN).families
        options = settings.options() + (
            "".join(f" --family {f}" for f in plan.families) if plan.families != default else ""
        )
        return f"""# epmoe or transformers' own expert parallelism: `epmoe bench versus`

Reproduce (from the repository root, after `scripts/setup.sh test`):

    .venv/bin/epmoe bench versus {options}

- Machine: {common.machine_description(settings.device)}; torch {torch.__version__}, transformers
  {transformers.__version__}. Run: {datetime.date.today().isoformat()}.
- Models: {", ".join(plan.families)} built from configs ({", ".join(f"{f}: {FAMILIES[f][0]} experts, top-{FAMILIES[f][1]}" for f in plan.families)}),
  hidden {plan.hidden}, expert width {plan.intermediate}, 2 layers, 4 attention and 2 key-value heads (4 for the shared-batch rows) (epmoe.models.build_model), saved with
  `save_pretrained` and loaded by every rank; EP {" and ".join(map(str, plan.worlds))} on gloo ranks sharing the
  machine's cores; {plan.tokens} tokens per rank per step; median of {settings.repeats} interleaved rounds after
  {settings.warmup} warm-up round(s).

{_markdown(__doc__)}

## Results

{self.markdown()}
"""


def _shared_batch_rows(shared: dict, world: int) -> list[tuple]:
    """The shared-batch figures' rows (epmoe's own column empty: it runs no TP mesh)."""
    where = f"shared batch (ep_size = tp_size = {world})"
    if "error" in shared:
        return [(f"{where}: transformers loads it", "", shared["error"], shared["error"], "", "")]
    rows = []
    figures = [(f"{where}: step time ms (fwd + bwd + AdamW)", shared["step"])]
    figures += [(f"{where}: decode batch {b} ms/token", by_system) for b, by_system in shared["decode"].items()]
    for label, by_system in figures:
        ms = {name: 1e3 * statistics.median(samples) for name, samples in by_system.items()}
        ratio = f"{ms['in transformers'] / ms['transformers']:.2f}"
        rows.append((label, "", f"{ms['in transformers']:.1f}", f"{ms['transformers']:.1f}", "", ratio))
    return rows


def _cells(values: dict, scale: float, fmt: str) -> tuple[str, ...]:
    """Each system's value, scaled and formatted (:data:`SYSTEMS` order)."""
    return tuple(fmt.format(values[name] * scale) for name in SYSTEMS)


def _ratios(values: dict) -> tuple[str, str]:
    """epmoe's and epmoe-in-transformers' value over transformers' own."""
    theirs = values["transformers"]
    return tuple(f"{values[name] / theirs:.2f}" if theirs else "-" for name in SYSTEMS[:2])


def _exact_cell(exact: dict, tolerance: float) -> str:
    """One system's exactness: exact or not, its largest differences, the worst parameter if not."""
    if "error" in exact:
        return f"error: {exact['error']}"
    verdict = "exact" if max(exact["loss"], exact["grads"]) <= tolerance else "NOT exact"
    worst = f": `{exact['worst']}`" if exact["grads"] > tolerance else ""
    return f"{verdict} (loss {exact['loss']:.1e}, gradients {exact['grads']:.1e}{worst})"


def _markdown(docstring: str) -> str:
    return docstring.split("\n", 2)[2].strip().replace("``", "`")


def _cell(value) -> str:
    return value if isinstance(value, str) else ("exact" if value <= EXACT else "NOT exact") + f" ({value:.1e})"


def _documented_features(first: str, refusal: str) -> list[tuple[str, ...]]:
    """The rows of :meth:`VersusReport.features` that the tests named in them check (``first``: the run whose
    checks are shown; ``refusal``: what transformers' EP said of Trainer checkpoints there)."""
    return [
        (
            "Trainer",
            "`epmoe.prepare_trainer`: every parameter equals the Trainer without EP (tests/training/test_launchers.py)",
            "takes the model as loaded",
            "takes the model as loaded",
        ),
        (
            "Trainer checkpoints, resume",
            "model and optimizer (DCP) in each checkpoint, resumed exactly at another "
            "world size (tests/training/test_launchers.py)",
            "as transformers' (the same load)",
            f"(this run: {first}) {refusal}",
        ),
        (
            "DeepSpeed ZeRO 1-3",
            "`epmoe.prepare_deepspeed`, exact (tests/training/test_deepspeed.py)",
            "none: `DistributedConfig` shards with FSDP2 at load",
            "none: `DistributedConfig` shards with FSDP2 at load",
        ),
        (
            "routing replay (RL), load telemetry",
            "`epmoe.record_routing` / `replay_routing` (tests/training/test_replay*.py), `epmoe.expert_load`",
            "the same calls on the loaded model (tests/models/test_transformers_ep.py)",
            "no API",
        ),
        (
            "TP mesh (`tp_size > 1`)",
            "none: EP x DP meshes",
            "ep_size == tp_size: nothing moves, partial outputs all-reduced; otherwise each TP rank "
            "exchanges its slice (tests/models/test_transformers_ep.py)",
            "`all_reduce` at inference where ep_size == tp_size, else `all_to_all` on TP slices",
        ),
    ]
