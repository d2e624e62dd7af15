"""Check and time epmoe on one CUDA GPU, in bf16: one command, under 8 minutes on one H200.

    python benchmarks/gpu_check.py --out benchmarks/gpu.md

1. Correctness first: every grouped-matmul backend eligible there (``torch``, ``batched``, ``loop``)
   against a float32 reference, for the forward output, ``dX`` and ``dW``, with and without
   ``trans_weight``, with empty groups (first, middle, last), all rows in one group, and counts
   given as a CUDA tensor. An empty group's ``dW`` must be exactly zero. Stops at the first failure.
2. Grouped matmul per backend and ``auto`` vs one dense bf16 ``torch.mm`` of the same FLOPs, forward
   and forward+backward, at per-rank shapes of Qwen3-30B-A3B and Qwen3.5-35B-A3B at EP=8, a
   small-group case and a decode-like 128-expert case (the columns of ``epmoe bench gmm``). Goal:
   >= 0.7 of dense throughput at >= 256 rows per group.
3. The MoE block, forward + backward (``epmoe bench layer`` part ep1 in bf16): epmoe vs transformers'
   ``grouped_mm`` and ``eager`` experts, the dense floor, the grouped matmuls' share profiled inside
   the step. Goal: epmoe <= 0.8x transformers' ``grouped_mm`` time.
4. ``torch.compile`` of the MoE block (epmoe, transformers' ``grouped_mm``) vs eager: step times, graph
   breaks and the largest gradient difference.
5. Peak device memory of one step of each block variant.
6. The lean data path at EP 1 (``epmoe bench layer`` part lean's EP 1 half, in bf16, at Qwen3-30B-A3B's
   and a Mixtral-like shape, 16384 tokens): elements saved for backward per token, epmoe's block vs
   transformers' ``grouped_mm`` block (measured) next to the formulas (plain autograd, Megatron-Core,
   SonicMoE, the bound H + 2KI + E); the step epmoe vs ``grouped_mm`` (goal: no slower beyond noise);
   the peak memory of one forward + backward of each above what was allocated before it.
7. ``dispatch="static"`` (sync-free expert parallelism, bf16, ``check_steps=False``, ``static_tokens``
   given): a decode step (batch 1 and 8, one new token per sequence, ``use_cache=False``) captured in
   a CUDA graph and replayed on new tokens against the eager step (logits, time), and a training
   step of ``torch.compile(model, fullgraph=True)`` against eager (loss, gradients, time). EP 1 in
   this process; EP 2 on two spawned ranks, one GPU each over NCCL (NCCL cannot put two ranks on one
   GPU), where at least two GPUs are present, else a line saying so.

Needs torch, transformers and epmoe. Exits with status 1 and a message when no CUDA device is present
or the ``torch`` backend declines there. ``--device cpu --quick`` runs every section on tiny shapes
(a smoke test of the script itself; no GPU figure comes from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import epmoe
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import epmoe

from epmoe import platform
from epmoe.bench import common, compiled, gmm, layer, lean
from epmoe.launch import run_ranks
from epmoe.models import build_model

TOLERANCE = 1.5e-2  # max |error| / max |reference|, for bf16 results with float32 accumulation
GPU_BLOCK_GOAL = 0.8  # epmoe block time / transformers grouped_mm block time
GPU_LEAN_TOKENS = 16384  # tokens of the lean shapes' blocks on the GPU

# (counts, K, N): empty groups first / in the middle / last, one full group, uneven sizes.
CHECKS = (
    ([128, 0, 37, 256, 0, 1, 300, 90], 2048, 1536),
    ([0, 64, 0, 0, 512, 0], 512, 2048),
    ([0, 0, 0, 1000, 0, 0, 0, 0], 1024, 256),
    ([3, 1, 0, 7, 2, 0, 0, 5] * 16, 2048, 1536),
)

CASES = (
    gmm.Case(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B at EP=8: 16 local experts, top-8, H=2048, I=768, 16384 tokens/rank",
        num_experts=16,
        hidden=2048,
        intermediate=768,
        tokens=16384,
        top_k=8,
        ep=8,
    ),
    gmm.Case(
        "qwen3.5-35b-a3b",
        "Qwen3.5-35B-A3B at EP=8: 32 local experts, top-8, H=2048, I=512, 16384 tokens/rank",
        num_experts=32,
        hidden=2048,
        intermediate=512,
        tokens=16384,
        top_k=8,
        ep=8,
    ),
    gmm.Case(
        "small-16",
        "128 experts, 16 rows each on average, max/mean 1.5; H=2048, I=768",
        num_experts=128,
        hidden=2048,
        intermediate=768,
        tokens=256,
        top_k=8,
        ep=1,
        projections=("gate_up",),
        spread=0.5,
    ),
    gmm.Case(
        "decode",
        "Qwen3-30B-A3B decoding without EP: 128 experts, top-8, 64 tokens",
        num_experts=128,
        hidden=2048,
        intermediate=768,
        tokens=64,
        top_k=8,
        ep=1,
        projections=("gate_up",),
    ),
)
QUICK_CHECKS = (([5, 0, 3, 0], 64, 32), ([0, 0, 9, 0], 32, 16))

# Section 7: the model of the static exchange's decode and training steps (Qwen3-MoE, bf16)
STATIC_MODEL = dict(
    hidden_size=1024,
    moe_intermediate_size=512,
    num_experts=64,
    top_k=8,
    num_hidden_layers=4,
    vocab_size=32000,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
)
QUICK_STATIC_MODEL = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, num_hidden_layers=2)
STATIC_DECODE_BATCHES = (1, 8)
STATIC_TRAIN_SHAPE = (4, 256)  # (sequences, tokens each) per rank
STATIC_HEADERS = (
    "EP",
    "step",
    "batch per rank",
    "eager ms",
    "graph / compiled ms",
    "speed-up",
    "max |diff| / max |ref|",
    "note",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="PATH", help="also write the report as markdown to PATH")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per measurement (median reported)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only with --quick, to test the script")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    if args.device != "cuda" and not args.quick:
        sys.exit("gpu_check: --device other than cuda only with --quick (a smoke test)")

    if not platform.is_available(args.device):
        sys.exit(
            "gpu_check: no CUDA device is present (torch.cuda.is_available() is False); nothing was checked"
            if args.device == "cuda"
            else f"gpu_check: no {args.device} device"
        )
    device = platform.current_device(args.device)
    probe_x = torch.zeros(256, 1024, dtype=torch.bfloat16, device=device)
    probe_w = torch.zeros(8, 1024, 1024, dtype=torch.bfloat16, device=device)
    statuses = {s.name: s for s in epmoe.gmm_backends(probe_x, probe_w)}
    if not statuses["torch"].eligible:
        sys.exit(f"gpu_check: the torch backend declines on this {args.device}: {statuses['torch'].reason}")
    backends = [name for name, status in statuses.items() if status.eligible]
    repeats = 2 if args.quick else args.repeats

    sections = [
        f"- Machine: {common.machine_description(device)}.",
        f"## Correctness: {', '.join(backends)} vs a float32 reference, bf16",
        "",
    ]
    print(f"# gpu_check: {common.machine_description(device)}\n")
    for counts, K, N in QUICK_CHECKS if args.quick else CHECKS:
        for trans_weight in (False, True):
            sections.append(check(counts, K, N, trans_weight, device, backends))
            print(sections[-1])

    settings = common.Settings(
        device,
        torch.get_num_threads(),
        warmup=1 if args.quick else 3,
        repeats=repeats,
        seed=0,
        quick=args.quick,
        out=args.out,
    )
    cases = gmm.QUICK_CASES if args.quick else CASES
    results = []
    for case in cases:
        for projection in case.projections:
            results += gmm.run_case(case, projection, "bf16", settings)
    table = common.markdown_table(gmm.HEADERS, [r.cells() for r in results], align="llllrrr")
    sections.append(
        f"\n## Grouped matmul (median of {repeats} rounds, side by side)\n\n{_cases(cases)}\n\n{table}\n\n"
        + "\n".join(gmm.summarize(results))
    )
    print(sections[-1])
    sections += block_sections(settings, layer.QUICK_SHAPES if args.quick else layer.SHAPES)
    sections += lean_sections(
        settings,
        lean.QUICK_PLAN.shapes
        if args.quick
        else [dataclasses.replace(s, tokens=GPU_LEAN_TOKENS) for s in lean.PLAN.shapes],
    )
    sections += static_sections(settings)
    report = "\n".join(sections) + "\n"
    if args.out:
        Path(args.out).write_text(f"# gpu_check: `python benchmarks/gpu_check.py`\n\n{report}")
        print(f"wrote {args.out}")
    return 0


def block_sections(settings: common.Settings, shapes) -> list[str]:
    """Sections 3-5: the MoE block in bf16 (bench layer ep1), compiled vs eager, peak memory."""
    ep1 = layer.Ep1Report([layer.run_ep1(shape, settings, dtype=torch.bfloat16) for shape in shapes])
    out = [
        "\n## The MoE block, forward + backward, bf16 (`epmoe bench layer` part ep1)\n",
        ep1.markdown().replace("### ", "#### "),
        f"GPU goal: epmoe <= {GPU_BLOCK_GOAL}x transformers' `grouped_mm` time.",
        "",
    ]
    rows, memory = [], []
    for shape in shapes:
        blocks = layer.build_blocks(shape, settings.seed, settings.device, torch.bfloat16)
        generator = torch.Generator().manual_seed(settings.seed + 1)
        x = torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(settings.device, torch.bfloat16)
        dy = torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(settings.device, torch.bfloat16)
        rows += [
            _compiled_vs_eager(shape, label, blocks[label], x, dy, settings) for label in (layer.EPMOE, layer.GROUPED)
        ]
        for label, block in blocks.items():
            memory.append((shape.name, label, _peak_step_mib(block, x, dy, settings.device)))
    out += [
        "## torch.compile of the MoE block vs eager, bf16\n",
        common.markdown_table(compiled.BLOCK_HEADERS, rows, align="llrrrrrlr"),
        "",
        "## Peak device memory of one forward + backward step\n",
        common.markdown_table(("shape", "variant", "peak MiB"), memory, align="llr"),
    ]
    print("\n".join(out))
    return out


def lean_sections(settings: common.Settings, shapes) -> list[str]:
    """Section 6: the lean data path at EP 1 in bf16 (bench layer part lean's saved elements and step)."""
    results = [lean.run_ep1(shape, settings, dtype=torch.bfloat16) for shape in shapes]
    out = [
        "\n## The lean data path at EP 1, bf16 (`epmoe bench layer` part lean, EP 1 half)\n",
        "\n".join(f"- {s.name}: {s.describe()}" for s in shapes),
        "",
        "### Saved for backward, elements per token\n",
        common.markdown_table(lean.SAVED_HEADERS, [r for result in results for r in result.saved_rows()], align="llrr"),
        "",
    ]
    out += [line for result in results for line in result.saved_lines()]
    out += [
        "- measured rows: the whole block (router included), in bf16 elements (one int64 index counts as "
        "four); formula rows: the experts (the bound adds the router's E probabilities)",
        "",
        "### Step (block forward + backward) and peak memory of one step\n",
        common.markdown_table(
            lean.EP1_STEP_HEADERS, [r for result in results for r in result.step_rows()], align="llrrrr"
        ),
        "",
    ]
    out += [result.step_verdict() for result in results]
    out.append(
        "- peak MiB above weights: the most allocated during one forward + backward above what was allocated "
        "before it (activations, the weights' gradients, workspace)"
    )
    print("\n".join(out))
    return out


def static_sections(settings: common.Settings) -> list[str]:
    """Section 7: ``dispatch="static"``: a CUDA-graph-captured decode step and a compiled training
    step, each against eager, at EP 1 here and at EP 2 on two GPUs (two gloo ranks on the CPU in a
    ``--device cpu`` smoke run, where no graph is captured)."""
    device = settings.device
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    rows, notes = [], []
    if device.type == "cuda":
        rows += _static_rows(0, 1, device, settings)
    else:
        notes.append("- EP 1: not run in a --device cpu smoke run (the EP 2 ranks run the same steps)")
    if device.type == "cpu" or gpus >= 2:
        backend = "gloo" if device.type == "cpu" else "nccl"
        rows += run_ranks(_static_rank, 2, device.type, settings, backend=backend, timeout=900)[0]
    else:
        notes.append(f"- EP 2: not run: it needs 2 GPUs (NCCL runs one rank per GPU; this machine has {gpus})")
    if device.type != "cuda":
        notes.append(f"- decode steps run eagerly only: a CUDA graph needs a CUDA device (this is {device.type})")
    model = QUICK_STATIC_MODEL if settings.quick else STATIC_MODEL
    sequences, length = _static_train_shape(settings.quick)
    out = [
        '\n## dispatch="static": a decode step in a CUDA graph, a compiled training step, bf16\n',
        f"- Qwen3-MoE, {', '.join(f'{k}={v}' for k, v in model.items())}; dispatch='static', check_steps=False, "
        f"static_tokens = the step's tokens per rank; decode: one new token per sequence, use_cache=False; "
        f"training: {sequences} x {length} tokens per rank, forward + backward, fullgraph=True",
        "- graph: the step captured once, replayed on new tokens; diff: its logits (decode) or the largest "
        "gradient difference (training) against the eager step on the same tokens, relative to the eager one's "
        "largest; time: median of the rounds, side by side (the slowest rank's at EP 2)",
        *notes,
        "",
        common.markdown_table(STATIC_HEADERS, rows, align="rlrrrrrl"),
    ]
    print("\n".join(out))
    return out


def _static_rank(rank: int, world: int, device_type: str, settings: common.Settings) -> list[tuple]:
    """One rank of the EP-2 runs of section 7 (its device: GPU ``rank``, or the CPU)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = platform.current_device(device_type)
    return _static_rows(rank, world, device, dataclasses.replace(settings, device=device))


def _static_rows(rank: int, world: int, device: torch.device, settings: common.Settings) -> list[tuple]:
    """Section 7's rows on this process (EP ``world``: the default group, or none at EP 1)."""
    rows = []
    for batch in STATIC_DECODE_BATCHES:
        rows.append(_guarded(world, "decode", batch, lambda b=batch: _static_decode(rank, world, b, device, settings)))
    sequences = _static_train_shape(settings.quick)[0]
    rows.append(_guarded(world, "train", sequences, lambda: _static_train(rank, world, device, settings)))
    return rows


def _static_train_shape(quick: bool) -> tuple[int, int]:
    """(sequences, tokens each) per rank of section 7's training step."""
    return (2, 16) if quick else STATIC_TRAIN_SHAPE


def _guarded(world: int, step: str, batch: int, run) -> tuple:
    """``run()``'s row, or a row naming the exception it raised (the other rows still stand)."""
    try:
        return (world, step, batch, *run())
    except Exception as error:  # noqa: BLE001 - report it; the other sections still stand
        return (world, step, batch, "-", "-", "-", "-", f"failed: {type(error).__name__}: {error}"[:160])


def _static_model(world: int, tokens: int, device: torch.device, quick: bool) -> torch.nn.Module:
    """The section's model on ``device`` in bf16, expert-parallel over the default group (or alone)."""
    shape = QUICK_STATIC_MODEL if quick else STATIC_MODEL
    model = build_model("qwen3_moe", **shape).to(device, torch.bfloat16)
    group = None if world > 1 else _own_group()
    epmoe.apply_expert_parallel(
        model, group, config={"dispatch": "static", "check_steps": False, "static_tokens": tokens}
    )
    return model


def _own_group():
    """A group of this process alone where a default group runs (EP 1 beside it), else ``None``."""
    return dist.new_group([dist.get_rank()]) if dist.is_initialized() else None


def _static_decode(rank: int, world: int, batch: int, device: torch.device, settings: common.Settings) -> tuple:
    """A decode step of ``batch`` sequences: eager, and on CUDA captured in a graph and replayed on
    new tokens: ``(eager ms, graph ms, speed-up, diff, note)``."""
    model = _static_model(world, batch, device, settings.quick).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(settings.seed + 7 * rank + batch)
    ids = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
    fresh = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)

    def eager():
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    steps = {"eager": eager}
    graph_logits = None
    if device.type == "cuda":
        graph, graph_ids, graph_logits = _capture(model, ids)
        steps["graph"] = graph.replay
    timings = common.measure(steps, warmup=settings.warmup, repeats=settings.repeats, device=device, ranks=world > 1)
    eager_ms = timings["eager"].median_s * 1e3
    if graph_logits is None:
        eager()
        return f"{eager_ms:.3f}", "-", "-", "-", "eager only (no CUDA graph off CUDA)"
    graph_ids.copy_(fresh)
    graph.replay()
    ids = fresh
    want = eager()
    diff = ((graph_logits.float() - want.float()).abs().max() / want.float().abs().max()).item()
    graph_ms = timings["graph"].median_s * 1e3
    verdict = "ok" if diff <= TOLERANCE else f"MISMATCH (> {TOLERANCE})"
    return f"{eager_ms:.3f}", f"{graph_ms:.3f}", f"{eager_ms / graph_ms:.2f}x", f"{diff:.1e}", verdict


def _capture(model: torch.nn.Module, ids: torch.Tensor):
    """``(graph, its input ids, its logits)``: ``model``'s decode step on ``ids`` captured in a CUDA
    graph, after warm-up steps on a side stream (as ``torch.cuda.graph`` asks)."""
    graph_ids = ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            model(graph_ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        logits = model(graph_ids, use_cache=False).logits
    return graph, graph_ids, logits


def _static_train(rank: int, world: int, device: torch.device, settings: common.Settings) -> tuple:
    """A training step of ``torch.compile(model, fullgraph=True)`` against the same model run
    eagerly: ``(eager ms, compiled ms, speed-up, largest relative gradient difference, graphs)``."""
    sequences, length = _static_train_shape(settings.quick)
    eager = _static_model(world, sequences * length, device, settings.quick)
    compiled_model = torch.compile(_static_model(world, sequences * length, device, settings.quick), fullgraph=True)
    generator = torch.Generator().manual_seed(settings.seed + 11 * rank)
    ids = torch.randint(0, eager.config.vocab_size, (sequences, length), generator=generator).to(device)

    def step(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    timings = common.measure(
        {"eager": lambda: step(eager), "compiled": lambda: step(compiled_model)},
        warmup=max(1, settings.warmup),
        repeats=settings.repeats,
        device=device,
        ranks=world > 1,
    )
    grads = {name.removeprefix("_orig_mod."): p.grad for name, p in compiled_model.named_parameters()}
    diff = max(
        ((grads[name].float() - p.grad.float()).abs().max() / p.grad.float().abs().max().clamp_min(1e-30)).item()
        for name, p in eager.named_parameters()
        if p.grad is not None
    )
    eager_ms, compiled_ms = timings["eager"].median_s * 1e3, timings["compiled"].median_s * 1e3
    return (
        f"{eager_ms:.1f}",
        f"{compiled_ms:.1f}",
        f"{eager_ms / compiled_ms:.2f}x",
        f"{diff:.1e}",
        "one graph (fullgraph=True)",
    )


def _compiled_vs_eager(shape, label, block, x, dy, settings) -> tuple:
    """One row of ``bench layer --part compile``'s block table, or the reason compiling failed."""
    try:
        return (shape.name, *compiled.compare_block(label, block, x, dy, settings).cells())
    except Exception as error:  # noqa: BLE001 - report it; the other sections still stand
        failed = f"torch.compile failed: {type(error).__name__}: {error}"[:160]
        return (shape.name, label, "-", "-", "-", "-", "-", failed, "-")


def _peak_step_mib(block, x, dy, device) -> str:
    platform.synchronize(device)
    platform.reset_peak_memory(device)
    layer.block_step(block, x, dy)()
    platform.synchronize(device)
    peak = platform.peak_memory(device)
    return "n/a (host memory)" if peak is None else f"{peak / 2**20:.0f}"


def check(counts: list[int], K: int, N: int, trans_weight: bool, device: torch.device, backends: list[str]) -> str:
    """Every backend in ``backends`` against a float32 loop on the same bf16 inputs (counts on the
    device for the first); raise on a mismatch, else the report line."""
    T, G = sum(counts), len(counts)
    generator = torch.Generator().manual_seed(T * 7 + G)
    x = torch.randn(T, K, generator=generator).to(device, torch.bfloat16)
    shape = (G, N, K) if trans_weight else (G, K, N)
    weight = torch.randn(shape, generator=generator).div_(K**0.5).to(device, torch.bfloat16)
    dy = torch.randn(T, N, generator=generator).to(device, torch.bfloat16)

    outputs = {}
    runs = [
        (name, torch.bfloat16, torch.tensor(counts, device=device) if i == 0 else counts)
        for i, name in enumerate(backends)
    ] + [("reference", torch.float32, counts)]
    for backend, dtype, counts_arg in runs:
        x_leaf = x.to(dtype, copy=True).requires_grad_()
        w_leaf = weight.to(dtype, copy=True).requires_grad_()
        y = epmoe.grouped_mm(
            x_leaf, w_leaf, counts_arg, trans_weight=trans_weight, backend="loop" if backend == "reference" else backend
        )
        y.backward(dy.to(dtype))
        outputs[backend] = (y.detach().float(), x_leaf.grad.float(), w_leaf.grad.float())
    platform.synchronize(device)

    errors = []
    for name, index in (("y", 0), ("dX", 1), ("dW", 2)):
        reference = outputs["reference"][index]
        scale = reference.abs().max().clamp_min(1e-6)
        for backend in backends:
            error = ((outputs[backend][index] - reference).abs().max() / scale).item()
            errors.append(f"{name} {backend} {error:.1e}")
            if not error <= TOLERANCE:
                raise AssertionError(
                    f"gpu_check: {backend} {name} off by {error:.3g} (relative to max) for "
                    f"counts={counts}, K={K}, N={N}, trans_weight={trans_weight}"
                )
    for backend in backends:
        for g, n in enumerate(counts):
            if n == 0 and torch.count_nonzero(outputs[backend][2][g]).item():
                raise AssertionError(f"gpu_check: {backend} dW of empty group {g} is not zero (counts={counts})")
    shown = counts if len(counts) <= 8 else f"{G} groups, {T} rows, {counts.count(0)} empty"
    return f"- ok: counts {shown}, K={K}, N={N}, trans_weight={trans_weight}: max error / max |ref|: " + ", ".join(
        errors
    )


def _cases(cases) -> str:
    rows = []
    for case in cases:
        counts = case.counts(0)
        rows.append((case.name, case.model, f"{min(counts)} / {case.rows / case.num_experts:.0f} / {max(counts)}"))
    return common.markdown_table(("case", "shape", "rows per group min / mean / max"), rows, align="lll")


if __name__ == "__main__":
    sys.exit(main())
