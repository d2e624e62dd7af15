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

try:
    import epmoe
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import epmoe

from epmoe import platform
from epmoe.bench import common, compiled, gmm, layer, lean

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
    gmm.Case("qwen3-30b-a3b", "Qwen3-30B-A3B at EP=8: 16 local experts, top-8, H=2048, I=768, 16384 tokens/rank",
             num_experts=16, hidden=2048, intermediate=768, tokens=16384, top_k=8, ep=8),
    gmm.Case("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B at EP=8: 32 local experts, top-8, H=2048, I=512, 16384 tokens/rank",
             num_experts=32, hidden=2048, intermediate=512, tokens=16384, top_k=8, ep=8),
    gmm.Case("small-16", "128 experts, 16 rows each on average, max/mean 1.5; H=2048, I=768",
             num_experts=128, hidden=2048, intermediate=768, tokens=256, top_k=8, ep=1, projections=("gate_up",),
             spread=0.5),
    gmm.Case("decode", "Qwen3-30B-A3B decoding without EP: 128 experts, top-8, 64 tokens",
             num_experts=128, hidden=2048, intermediate=768, tokens=64, top_k=8, ep=1, projections=("gate_up",)),
)
QUICK_CHECKS = (([5, 0, 3, 0], 64, 32), ([0, 0, 9, 0], 32, 16))


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
        sys.exit("gpu_check: no CUDA device is present (torch.cuda.is_available() is False); nothing was checked"
                 if args.device == "cuda" else f"gpu_check: no {args.device} device")
    device = platform.current_device(args.device)
    probe_x = torch.zeros(256, 1024, dtype=torch.bfloat16, device=device)
    probe_w = torch.zeros(8, 1024, 1024, dtype=torch.bfloat16, device=device)
    statuses = {s.name: s for s in epmoe.gmm_backends(probe_x, probe_w)}
    if not statuses["torch"].eligible:
        sys.exit(f"gpu_check: the torch backend declines on this {args.device}: {statuses['torch'].reason}")
    backends = [name for name, status in statuses.items() if status.eligible]
    repeats = 2 if args.quick else args.repeats

    sections = [f"- Machine: {common.machine_description(device)}.",
                f"## Correctness: {', '.join(backends)} vs a float32 reference, bf16", ""]
    print(f"# gpu_check: {common.machine_description(device)}\n")
    for counts, K, N in QUICK_CHECKS if args.quick else CHECKS:
        for trans_weight in (False, True):
            sections.append(check(counts, K, N, trans_weight, device, backends))
            print(sections[-1])

    settings = common.Settings(device, torch.get_num_threads(), warmup=1 if args.quick else 3, repeats=repeats,
                               seed=0, quick=args.quick, out=args.out)
    cases = gmm.QUICK_CASES if args.quick else CASES
    results = []
    for case in cases:
        for projection in case.projections:
            results += gmm.run_case(case, projection, "bf16", settings)
    table = common.markdown_table(gmm.HEADERS, [r.cells() for r in results], align="llllrrr")
    sections.append(f"\n## Grouped matmul (median of {repeats} rounds, side by side)\n\n{_cases(cases)}\n\n{table}\n\n"
                    + "\n".join(gmm.summarize(results)))
    print(sections[-1])
    sections += block_sections(settings, layer.QUICK_SHAPES if args.quick else layer.SHAPES)
    sections += lean_sections(settings, lean.QUICK_PLAN.shapes if args.quick else
                              [dataclasses.replace(s, tokens=GPU_LEAN_TOKENS) for s in lean.PLAN.shapes])
    report = "\n".join(sections) + "\n"
    if args.out:
        Path(args.out).write_text(f"# gpu_check: `python benchmarks/gpu_check.py`\n\n{report}")
        print(f"wrote {args.out}")
    return 0


def block_sections(settings: common.Settings, shapes) -> list[str]:
    """Sections 3-5: the MoE block in bf16 (bench layer ep1), compiled vs eager, peak memory."""
    ep1 = layer.Ep1Report([layer.run_ep1(shape, settings, dtype=torch.bfloat16) for shape in shapes])
    out = ["\n## The MoE block, forward + backward, bf16 (`epmoe bench layer` part ep1)\n",
           ep1.markdown().replace("### ", "#### "),
           f"GPU goal: epmoe <= {GPU_BLOCK_GOAL}x transformers' `grouped_mm` time.", ""]
    rows, memory = [], []
    for shape in shapes:
        blocks = layer.build_blocks(shape, settings.seed, settings.device, torch.bfloat16)
        generator = torch.Generator().manual_seed(settings.seed + 1)
        x = torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(settings.device, torch.bfloat16)
        dy = torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(settings.device, torch.bfloat16)
        rows += [_compiled_vs_eager(shape, label, blocks[label], x, dy, settings) for label in (layer.EPMOE, layer.GROUPED)]
        for label, block in blocks.items():
            memory.append((shape.name, label, _peak_step_mib(block, x, dy, settings.device)))
    out += ["## torch.compile of the MoE block vs eager, bf16\n",
            common.markdown_table(compiled.BLOCK_HEADERS, rows, align="llrrrrrlr"), "",
            "## Peak device memory of one forward + backward step\n",
            common.markdown_table(("shape", "variant", "peak MiB"), memory, align="llr")]
    print("\n".join(out))
    return out


def lean_sections(settings: common.Settings, shapes) -> list[str]:
    """Section 6: the lean data path at EP 1 in bf16 (bench layer part lean's saved elements and step)."""
    results = [lean.run_ep1(shape, settings, dtype=torch.bfloat16) for shape in shapes]
    out = ["\n## The lean data path at EP 1, bf16 (`epmoe bench layer` part lean, EP 1 half)\n",
           "\n".join(f"- {s.name}: {s.describe()}" for s in shapes), "",
           "### Saved for backward, elements per token\n",
           common.markdown_table(lean.SAVED_HEADERS, [r for result in results for r in result.saved_rows()],
                                 align="llrr"), ""]
    out += [line for result in results for line in result.saved_lines()]
    out += ["- measured rows: the whole block (router included), in bf16 elements (one int64 index counts as "
            "four); formula rows: the experts (the bound adds the router's E probabilities)", "",
            "### Step (block forward + backward) and peak memory of one step\n",
            common.markdown_table(lean.EP1_STEP_HEADERS, [r for result in results for r in result.step_rows()],
                                  align="llrrrr"), ""]
    out += [result.step_verdict() for result in results]
    out.append("- peak MiB above weights: the most allocated during one forward + backward above what was allocated "
               "before it (activations, the weights' gradients, workspace)")
    print("\n".join(out))
    return out


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
    weight = torch.randn(shape, generator=generator).div_(K ** 0.5).to(device, torch.bfloat16)
    dy = torch.randn(T, N, generator=generator).to(device, torch.bfloat16)

    outputs = {}
    runs = [(name, torch.bfloat16, torch.tensor(counts, device=device) if i == 0 else counts)
            for i, name in enumerate(backends)] + [("reference", torch.float32, counts)]
    for backend, dtype, counts_arg in runs:
        x_leaf = x.to(dtype, copy=True).requires_grad_()
        w_leaf = weight.to(dtype, copy=True).requires_grad_()
        y = epmoe.grouped_mm(x_leaf, w_leaf, counts_arg, trans_weight=trans_weight,
                             backend="loop" if backend == "reference" else backend)
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
                raise AssertionError(f"gpu_check: {backend} {name} off by {error:.3g} (relative to max) for "
                                     f"counts={counts}, K={K}, N={N}, trans_weight={trans_weight}")
    for backend in backends:
        for g, n in enumerate(counts):
            if n == 0 and torch.count_nonzero(outputs[backend][2][g]).item():
                raise AssertionError(f"gpu_check: {backend} dW of empty group {g} is not zero (counts={counts})")
    shown = counts if len(counts) <= 8 else f"{G} groups, {T} rows, {counts.count(0)} empty"
    return (f"- ok: counts {shown}, K={K}, N={N}, trans_weight={trans_weight}: max error / max |ref|: "
            + ", ".join(errors))


def _cases(cases) -> str:
    rows = []
    for case in cases:
        counts = case.counts(0)
        rows.append((case.name, case.model, f"{min(counts)} / {case.rows / case.num_experts:.0f} / {max(counts)}"))
    return common.markdown_table(("case", "shape", "rows per group min / mean / max"), rows, align="lll")


if __name__ == "__main__":
    sys.exit(main())
