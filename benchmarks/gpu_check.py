"""Check and time epmoe's ``torch`` grouped-matmul backend on one CUDA GPU, in bf16.

    python benchmarks/gpu_check.py [--out benchmarks/gmm_gpu.md]

1. Correctness: ``grouped_mm(..., backend="torch")`` against ``backend="loop"`` and a float32
   reference, for the forward output, ``dX`` and ``dW``, with and without ``trans_weight``, with
   empty groups (first, middle, last), all rows in one group, and counts given as a CUDA tensor.
   An empty group's ``dW`` must be exactly zero.
2. Timing: ``torch`` vs ``loop`` vs ``auto`` vs one dense bf16 ``torch.mm`` of the same FLOPs, forward
   and forward+backward, at per-rank shapes of Qwen3-30B-A3B and Qwen3.5-35B-A3B at EP=8 (plus a
   decode-like 128-expert case), printed as a markdown table (the columns of ``epmoe bench gmm``).

Needs only torch and epmoe; takes about a minute on one recent GPU (well under 8). Exits with
status 1 and a message when no CUDA device is present or the ``torch`` backend declines there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import epmoe
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import epmoe

from epmoe import platform
from epmoe.bench import common, gmm

TOLERANCE = 1.5e-2  # max |error| / max |reference|, for bf16 results with float32 accumulation

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
    gmm.Case("decode", "Qwen3-30B-A3B decoding without EP: 128 experts, top-8, 64 tokens",
             num_experts=128, hidden=2048, intermediate=768, tokens=64, top_k=8, ep=1, projections=("gate_up",)),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="PATH", help="also write the timing table as markdown to PATH")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per measurement (median reported)")
    args = parser.parse_args(argv)

    if not platform.is_available("cuda"):
        sys.exit("gpu_check: no CUDA device is present (torch.cuda.is_available() is False); nothing was checked")
    device = platform.current_device("cuda")
    probe_x = torch.zeros(256, 1024, dtype=torch.bfloat16, device=device)
    probe_w = torch.zeros(8, 1024, 1024, dtype=torch.bfloat16, device=device)
    torch_status = next(s for s in epmoe.gmm_backends(probe_x, probe_w) if s.name == "torch")
    if not torch_status.eligible:
        sys.exit(f"gpu_check: the torch backend declines on this GPU: {torch_status.reason}")

    print(f"# gpu_check: {common.machine_description(device)}\n")
    print("## Correctness: torch vs loop vs float32 reference, bf16\n")
    for counts, K, N in CHECKS:
        for trans_weight in (False, True):
            check(counts, K, N, trans_weight, device)

    settings = common.Settings(device, torch.get_num_threads(), warmup=3, repeats=args.repeats, seed=0,
                               quick=False, out=args.out)
    results = []
    for case in CASES:
        for projection in case.projections:
            results += gmm.run_case(case, projection, "bf16", settings, backends=["torch", "loop"])
    table = common.markdown_table(gmm.HEADERS, [r.cells() for r in results], align="llllrrr")
    summary = "\n".join(gmm.summarize(results))
    report = (f"\n## Timing (median of {args.repeats} rounds, side by side)\n\n{_cases(CASES)}\n\n{table}\n\n"
              f"{summary}\n")
    print(report)
    if args.out:
        Path(args.out).write_text(f"# gpu_check: `python benchmarks/gpu_check.py`\n\n"
                                  f"- Machine: {common.machine_description(device)}.\n{report}")
        print(f"wrote {args.out}")
    return 0


def check(counts: list[int], K: int, N: int, trans_weight: bool, device: torch.device) -> None:
    """``torch`` and ``loop`` against a float32 loop on the same bf16 inputs; raise on a mismatch."""
    T, G = sum(counts), len(counts)
    generator = torch.Generator().manual_seed(T * 7 + G)
    x = torch.randn(T, K, generator=generator).to(device, torch.bfloat16)
    shape = (G, N, K) if trans_weight else (G, K, N)
    weight = torch.randn(shape, generator=generator).div_(K ** 0.5).to(device, torch.bfloat16)
    dy = torch.randn(T, N, generator=generator).to(device, torch.bfloat16)
    counts_cuda = torch.tensor(counts, device=device)

    outputs = {}
    for backend, dtype, counts_arg in (("torch", torch.bfloat16, counts_cuda), ("loop", torch.bfloat16, counts),
                                       ("reference", torch.float32, counts)):
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
        for backend in ("torch", "loop"):
            error = ((outputs[backend][index] - reference).abs().max() / scale).item()
            errors.append(f"{name} {backend} {error:.1e}")
            if not error <= TOLERANCE:
                raise AssertionError(f"gpu_check: {backend} {name} off by {error:.3g} (relative to max) for "
                                     f"counts={counts}, K={K}, N={N}, trans_weight={trans_weight}")
        versus = ((outputs["torch"][index] - outputs["loop"][index]).abs().max() / scale).item()
        if not versus <= TOLERANCE:
            raise AssertionError(f"gpu_check: torch and loop {name} differ by {versus:.3g} for counts={counts}")
    dw_torch = outputs["torch"][2]
    for g, n in enumerate(counts):
        if n == 0 and torch.count_nonzero(dw_torch[g]).item():
            raise AssertionError(f"gpu_check: torch dW of empty group {g} is not zero (counts={counts})")
    shown = counts if len(counts) <= 8 else f"{G} groups, {T} rows, {counts.count(0)} empty"
    print(f"- ok: counts {shown}, K={K}, N={N}, trans_weight={trans_weight}: max error / max |ref|: "
          + ", ".join(errors))


def _cases(cases) -> str:
    rows = []
    for case in cases:
        counts = case.counts(0)
        rows.append((case.name, case.model, f"{min(counts)} / {case.rows / case.num_experts:.0f} / {max(counts)}"))
    return common.markdown_table(("case", "shape", "rows per group min / mean / max"), rows, align="lll")


if __name__ == "__main__":
    sys.exit(main())
