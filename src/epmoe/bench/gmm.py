"""``epmoe bench gmm``: grouped matmul per backend and ``auto``, against one dense matmul of equal FLOPs.

One case is one MoE projection on one rank, after dispatch: ``T`` rows sorted by local expert,
``counts`` rows per expert (seeded, mildly imbalanced), weights in the ``nn.Linear`` layout of
Hugging Face checkpoints, passed as ``grouped_mm(x, weight, counts, trans_weight=True)``::

    gate_up   x (T, H)  @  weight (G, 2I, H)^T  ->  (T, 2I)        D = H,  N = 2I
    down      x (T, I)  @  weight (G, H, I)^T   ->  (T, H)         D = I,  N = H

The baseline is one ``torch.mm`` of the same FLOPs: ``(T, D) @ (D, N)``, the ``(D, N)`` operand
being an ``(N, D)`` weight transposed, as the grouped call reads it. ``fwd+bwd`` adds ``dX`` and
``dW`` (three times the forward FLOPs) on both sides. Within one case, dtype and pass, every
eligible backend, ``auto`` and the dense matmul are timed side by side (:func:`common.measure`).

The per-call BLAS ceiling (:func:`run_ceiling`) bounds what any grouped matmul built from one BLAS
call per group can reach: for each ``(D, N)`` and ``T`` of the cases, one ``torch.mm`` of ``M`` rows
per group, each group with its own ``(N, D)`` weight as in a grouped call, against one ``mm`` of all
``T`` rows, forward fp32, for ``M`` from 64 to 1024 rows.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epmoe.bench import common
from epmoe.gmm import gmm_backends, grouped_mm, select_backend

HEADERS = ("case", "dtype", "pass", "backend", "time ms", "GFLOP/s", "ratio to dense")
PASSES = ("fwd", "fwd+bwd")
IMBALANCE = 0.3  # sigma of the log-normal expert popularity the counts are drawn from
LARGE_ROWS = 256  # mean rows per group from which auto should reach GOAL_RATIO of dense throughput
GOAL_RATIO = 0.9
NOISE = 0.05  # time differences below this fraction are reported as noise
CEILING_ROWS = (64, 128, 256, 512, 1024)  # rows per group M of the per-call BLAS ceiling


@dataclass(frozen=True)
class Case:
    """One rank's experts of a model: ``tokens * top_k / ep`` rows over ``num_experts`` local experts."""

    name: str
    model: str  # what the shape stands for, with any scaling stated
    num_experts: int  # G, experts on this rank
    hidden: int  # H
    intermediate: int  # I, per expert (gate_up has 2I outputs)
    tokens: int  # tokens per rank before dispatch
    top_k: int
    ep: int
    projections: tuple[str, ...] = ("gate_up", "down")
    imbalance: float = IMBALANCE  # sigma of the log-normal expert popularity
    spread: float | None = None  # instead: counts evenly spread over mean * (1 -/+ spread), shuffled

    @property
    def rows(self) -> int:
        """``T``: rows this rank's experts receive, on average over ranks (``tokens * top_k / ep``)."""
        return self.tokens * self.top_k // self.ep

    def dims(self, projection: str) -> tuple[int, int]:
        """``(D, N)`` of a projection."""
        if projection == "gate_up":
            return self.hidden, 2 * self.intermediate
        if projection == "down":
            return self.intermediate, self.hidden
        raise ValueError(f"unknown projection {projection!r}")

    def counts(self, seed: int) -> list[int]:
        """Rows per local expert summing to ``rows``: each row picks an expert by log-normal popularity,
        or (with ``spread``) group sizes spread evenly around the mean."""
        generator = torch.Generator().manual_seed(seed)
        if self.spread is not None:
            G, mean = self.num_experts, self.rows / self.num_experts
            sizes = [round(mean * (1 - self.spread + 2 * self.spread * g / max(G - 1, 1))) for g in range(G)]
            for g in range((self.rows - sum(sizes)) % G if sum(sizes) < self.rows else 0):
                sizes[g] += 1
            while sum(sizes) > self.rows:
                sizes[sizes.index(max(sizes))] -= 1
            return [sizes[i] for i in torch.randperm(G, generator=generator).tolist()]
        popularity = torch.exp(self.imbalance * torch.randn(self.num_experts, generator=generator))
        picks = torch.multinomial(popularity, self.rows, replacement=True, generator=generator)
        return torch.bincount(picks, minlength=self.num_experts).tolist()


CASES = (
    Case(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B at EP=8: 128 experts / 8 ranks, top-8; H, I as in the model",
        num_experts=16,
        hidden=2048,
        intermediate=768,
        tokens=4096,
        top_k=8,
        ep=8,
    ),
    Case(
        "qwen3.5-35b-a3b",
        "Qwen3.5-35B-A3B at EP=8: 256 experts / 8 ranks, top-8; H, I as in the model",
        num_experts=32,
        hidden=2048,
        intermediate=512,
        tokens=8192,
        top_k=8,
        ep=8,
    ),
    Case(
        "mixtral-like",
        "Mixtral-8x7B without EP: 8 experts, top-2; H=4096, I=14336 scaled by 1/4",
        num_experts=8,
        hidden=1024,
        intermediate=3584,
        tokens=1024,
        top_k=2,
        ep=1,
    ),
    Case(
        "qwen3-30b-a3b-2x",
        "as qwen3-30b-a3b with twice the tokens: 512 rows per group on average",
        num_experts=16,
        hidden=2048,
        intermediate=768,
        tokens=8192,
        top_k=8,
        ep=8,
        projections=("gate_up",),
    ),
    Case(
        "decode",
        "Qwen3-30B-A3B decoding without EP: 128 experts, top-8, 64 tokens; H, I as in the model. "
        "Bound by reading every expert's weight for a few rows",
        num_experts=128,
        hidden=2048,
        intermediate=768,
        tokens=64,
        top_k=8,
        ep=1,
        projections=("gate_up",),
    ),
    *(
        Case(
            f"small-{rows}",
            f"128 experts, {rows} rows each on average, max/mean 1.5 (evenly spread); H, I of Qwen3-30B-A3B",
            num_experts=128,
            hidden=2048,
            intermediate=768,
            tokens=rows * 16,
            top_k=8,
            ep=1,
            projections=("gate_up",),
            spread=0.5,
        )
        for rows in (8, 16, 32, 64)
    ),
    Case(
        "small-16-skewed",
        "128 experts, 16 rows each on average, log-normal popularity sigma 1.0; H, I of Qwen3-30B-A3B",
        num_experts=128,
        hidden=2048,
        intermediate=768,
        tokens=256,
        top_k=8,
        ep=1,
        projections=("gate_up",),
        imbalance=1.0,
    ),
)
QUICK_CASES = (
    Case(
        "tiny", "smoke test: 4 experts, H=64, I=32", num_experts=4, hidden=64, intermediate=32, tokens=64, top_k=2, ep=1
    ),
    Case(
        "tiny-decode",
        "smoke test: 16 experts, 1 row each on average",
        num_experts=16,
        hidden=64,
        intermediate=32,
        tokens=8,
        top_k=2,
        ep=1,
        projections=("gate_up",),
    ),
)


@dataclass(frozen=True)
class Result:
    """One row of the table."""

    case: str
    projection: str
    dtype: str
    pass_: str
    label: str  # backend name, "auto (<picked>)" or "dense mm"
    backend: str | None  # the grouped backend that ran; None for the dense baseline
    auto: bool
    seconds: float
    flops: float
    dense_seconds: float
    mean_rows: float
    spread: float  # (max - min) / median of the rounds: how disturbed this measurement was

    @property
    def ratio(self) -> float:
        """Grouped throughput over dense throughput (equal FLOPs, so the inverse time ratio)."""
        return self.dense_seconds / self.seconds

    def cells(self) -> tuple:
        return (
            f"{self.case} {self.projection}",
            self.dtype,
            self.pass_,
            self.label,
            f"{self.seconds * 1e3:.4g}",
            f"{self.flops / self.seconds / 1e9:.1f}",
            f"{self.ratio:.2f}",
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = [c.name for c in CASES + QUICK_CASES]
    parser.add_argument("--case", action="append", choices=names, help="run only this case (repeatable)")
    parser.add_argument(
        "--dtype",
        action="append",
        choices=list(common.DTYPES),
        help="run only this dtype (repeatable; default: fp32 and bf16)",
    )
    common.renamed_option(
        parser,
        "--gmm-backend",
        "--backend",
        dest="gmm_backend",
        append=True,
        default=None,
        help="time only this grouped-matmul backend besides auto (repeatable; default: every eligible one)",
    )


def run(args: argparse.Namespace) -> int:
    settings = common.configure(args)
    cases = _chosen_cases(args)
    dtypes = args.dtype or ["fp32", "bf16"]
    load_start = common.load_average()
    results = []
    for case in cases:
        for projection in case.projections:
            for dtype in dtypes:
                results += run_case(case, projection, dtype, settings, backends=args.gmm_backend)
    ceiling = run_ceiling(cases, settings)
    load = (load_start, common.load_average())
    table = common.markdown_table(HEADERS, [r.cells() for r in results], align="llllrrr")
    print(table)
    ceiling_table = _ceiling_table(ceiling)
    if ceiling:
        print()
        print(ceiling_table)
    summary = summarize(results) + summarize_ceiling(ceiling)
    print()
    print("\n".join(summary))
    if settings.out:
        with open(settings.out, "w") as out:
            out.write(_document(cases, settings, table, ceiling_table, summary, args, load))
        print(f"\nwrote {settings.out}")
    return 0


def _chosen_cases(args: argparse.Namespace) -> tuple[Case, ...]:
    if not args.case:
        return QUICK_CASES if args.quick else CASES
    return tuple(c for c in CASES + QUICK_CASES if c.name in args.case)


def run_case(
    case: Case, projection: str, dtype_name: str, settings: common.Settings, *, backends: list[str] | None = None
) -> list[Result]:
    """Time one case, projection and dtype, each pass: the table's rows, in table order.

    The candidates are every eligible grouped-matmul backend (or those named in ``backends``),
    ``auto``, and the dense baseline, timed side by side.
    """
    dtype, device = common.DTYPES[dtype_name], settings.device
    counts = case.counts(settings.seed)
    D, N = case.dims(projection)
    T, G = case.rows, case.num_experts
    generator = torch.Generator().manual_seed(settings.seed + 1)
    x_TD = torch.randn(T, D, generator=generator).to(device, dtype)
    weight_GND = torch.randn(G, N, D, generator=generator).div_(D**0.5).to(device, dtype)
    dense_ND = torch.randn(N, D, generator=generator).div_(D**0.5).to(device, dtype)
    dy_TN = torch.randn(T, N, generator=generator).to(device, dtype)

    eligible = [s.name for s in gmm_backends(x_TD, weight_GND, trans_weight=True) if s.eligible]
    unknown = sorted(set(backends or []) - set(eligible))
    if unknown:
        raise ValueError(f"--gmm-backend: {unknown} not eligible here (eligible: {eligible})")
    timed = [b for b in eligible if backends is None or b in backends]
    results = []
    for pass_ in PASSES:
        picked = select_backend(x_TD, weight_GND, trans_weight=True, counts=counts, backward=pass_ != "fwd").name
        candidates: dict[str, tuple[str | None, bool]] = {name: (name, False) for name in timed}
        candidates[f"auto ({picked})"] = ("auto", True)
        candidates["dense mm"] = (None, False)
        fns = {
            label: _call(pass_, backend, x_TD, weight_GND, dense_ND, dy_TN, counts)
            for label, (backend, _) in candidates.items()
        }
        timings = common.measure(fns, warmup=settings.warmup, repeats=settings.repeats, device=device)
        flops = 2.0 * T * D * N * (3 if pass_ == "fwd+bwd" else 1)
        dense_s = timings["dense mm"].median_s
        for label, (backend, is_auto) in candidates.items():
            ran = picked if is_auto else backend
            results.append(
                Result(
                    case.name,
                    projection,
                    dtype_name,
                    pass_,
                    label,
                    ran,
                    is_auto,
                    timings[label].median_s,
                    flops,
                    dense_s,
                    T / G,
                    timings[label].spread,
                )
            )
    return results


def _call(pass_: str, backend: str | None, x_TD, weight_GND, dense_ND, dy_TN, counts) -> Callable[[], object]:
    """The timed closure: grouped_mm on ``backend`` (or the dense mm for ``None``), forward or both passes."""
    if backend is None:
        weight = dense_ND

        def forward(x, w):
            return torch.mm(x, w.t())
    else:
        weight = weight_GND

        def forward(x, w):
            return grouped_mm(x, w, counts, trans_weight=True, backend=backend)

    if pass_ == "fwd":
        return lambda: forward(x_TD, weight)
    x_leaf, w_leaf = x_TD.detach().requires_grad_(), weight.detach().requires_grad_()
    return lambda: torch.autograd.grad(forward(x_leaf, w_leaf), (x_leaf, w_leaf), dy_TN)


def run_ceiling(cases, settings: common.Settings) -> dict[tuple[int, int, int], dict[int, float]]:
    """``{(D, N, T): {M: ratio}}``: one fp32 ``torch.mm`` per group of ``M`` rows, each group with its own
    weight, over one ``mm`` of all ``T`` rows (throughput ratio, timed side by side).

    Only cases whose groups average at least 64 rows; ``M`` up to ``T / 2``.
    """
    shapes = sorted(
        {
            (*case.dims(p), case.rows)
            for case in cases
            for p in case.projections
            if case.rows / case.num_experts >= CEILING_ROWS[0]
        }
    )
    generator = torch.Generator().manual_seed(settings.seed + 2)
    ceiling = {}
    for D, N, T in shapes:
        row_counts = [m for m in CEILING_ROWS if 2 * m <= T]
        x_TD = torch.randn(T, D, generator=generator).to(settings.device)
        weights_GND = torch.randn(T // min(row_counts), N, D, generator=generator).to(settings.device)

        def per_call(m: int) -> Callable[[], object]:
            return lambda: [torch.mm(x_TD[i * m : (i + 1) * m], weights_GND[i].t()) for i in range(T // m)]

        fns = {m: per_call(m) for m in row_counts}
        fns["all"] = lambda: torch.mm(x_TD, weights_GND[0].t())
        timings = common.measure(fns, warmup=settings.warmup, repeats=settings.repeats, device=settings.device)
        ceiling[(D, N, T)] = {m: timings["all"].median_s / timings[m].median_s for m in row_counts}
    return ceiling


def _ceiling_table(ceiling: dict[tuple[int, int, int], dict[int, float]]) -> str:
    if not ceiling:
        return f"(no case here has {CEILING_ROWS[0]}+ rows per group)"
    headers = ("D x N", "rows T", *(f"M = {m}" for m in CEILING_ROWS))
    rows = [
        (f"{D}x{N}", T, *(f"{ratios[m]:.2f}" if m in ratios else "" for m in CEILING_ROWS))
        for (D, N, T), ratios in ceiling.items()
    ]
    return common.markdown_table(headers, rows, align="lr" + "r" * len(CEILING_ROWS))


def summarize_ceiling(ceiling: dict[tuple[int, int, int], dict[int, float]]) -> list[str]:
    """One bullet: the per-call BLAS ceiling at ``LARGE_ROWS`` rows per group against ``GOAL_RATIO``."""
    at_large = [(ratios[LARGE_ROWS], key) for key, ratios in ceiling.items() if LARGE_ROWS in ratios]
    if not at_large:
        return []
    below = [f"{D}x{N} ({q:.2f})" for q, (D, N, _) in sorted(at_large) if q < GOAL_RATIO]
    return [
        f"- Per-call BLAS ceiling (fp32 forward, one `torch.mm` per {LARGE_ROWS}-row group with its own weight, "
        f"over one `mm` of all rows): {min(at_large)[0]:.2f} to {max(at_large)[0]:.2f}; "
        + (
            f"below {GOAL_RATIO}x for {'; '.join(below)}: no grouped matmul made of one BLAS call per group "
            f"reaches {GOAL_RATIO}x dense forward there on this machine."
            if below
            else f"at least {GOAL_RATIO}x for every shape."
        )
    ]


def summarize(results: list[Result]) -> list[str]:
    """Markdown bullets: noise, auto's pick, torch vs loop, auto vs the best backend, the 0.9x-dense goal.

    The noise floor is measured, not assumed: ``auto`` and the backend it picks run the same code, so
    the largest gap between their two rows (or ``NOISE``, if larger) is what a difference between
    backends must exceed to count; in a row whose own rounds spread wider (``1 + spread`` of the two
    compared results), that wider band.
    """
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault((r.case, r.projection, r.dtype, r.pass_), []).append(r)
    same_code, picked_vs_best = [], []
    for key, rows in groups.items():
        auto = next(r for r in rows if r.auto)
        singles = _singles(rows)
        if auto.backend in singles:
            picked, best = singles[auto.backend], min(singles.values(), key=lambda r: r.seconds)
            same_code.append(auto.seconds / picked.seconds)
            picked_vs_best.append((picked.seconds / best.seconds, key, picked, best))
    floor = max([1 + NOISE] + [max(q, 1 / q) for q in same_code])

    def beyond_noise(q: float, a: Result, b: Result) -> bool:
        return q > max(floor, 1 + a.spread, 1 + b.spread)

    lines = _noise_bullets(results, same_code, floor)
    lines += _torch_vs_loop_bullet(groups, beyond_noise)
    lines += _picked_vs_best_bullet(picked_vs_best, beyond_noise)
    return lines + _large_groups_bullet(groups)


def _name(key: tuple) -> str:
    return " ".join(key)


def _singles(rows: list[Result]) -> dict[str, Result]:
    """A group's rows of one named backend each (not ``auto``), by backend."""
    return {r.backend: r for r in rows if not r.auto and r.backend is not None}


def _noise_bullets(results: list[Result], same_code: list[float], floor: float) -> list[str]:
    spreads = sorted(r.spread for r in results)
    noisiest = max(results, key=lambda r: r.spread)
    return [
        f"- Noise: (slowest - fastest round) / median is {statistics.median(spreads):.0%} for the median row, "
        f"{noisiest.spread:.0%} at worst ({noisiest.case} {noisiest.projection} {noisiest.dtype} {noisiest.pass_} "
        f"{noisiest.label})"
        + (
            f"; `auto` and the backend it picked (the same code) differ by {min(same_code):.2f}x to "
            f"{max(same_code):.2f}x, so differences within {floor:.2f}x (or a row's own `1 + spread`, where "
            f"wider) are noise."
            if same_code
            else "."
        ),
        f"- `auto` picked: {', '.join(sorted({r.backend for r in results if r.auto}))}.",
    ]


def _torch_vs_loop_bullet(groups: dict[tuple, list[Result]], beyond_noise: Callable) -> list[str]:
    torch_vs_loop = []
    for key, rows in groups.items():
        singles = _singles(rows)
        if "torch" in singles and "loop" in singles:
            torch, loop = singles["torch"], singles["loop"]
            torch_vs_loop.append((torch.seconds / loop.seconds, key, torch, loop))
    if not torch_vs_loop:
        return []
    ratios = [q for q, *_ in torch_vs_loop]
    worst, worst_key, *_ = max(torch_vs_loop, key=lambda t: t[0])
    slower = [
        f"{_name(k)} ({q:.2f})" for q, k, a, b in sorted(torch_vs_loop, key=lambda t: -t[0]) if beyond_noise(q, a, b)
    ]
    return [
        f"- `torch` time / `loop` time: median {statistics.median(ratios):.2f}, from {min(ratios):.2f} to "
        f"{worst:.2f} ({_name(worst_key)}); "
        + (f"slower beyond noise in: {'; '.join(slower)}." if slower else "never slower beyond noise.")
    ]


def _picked_vs_best_bullet(picked_vs_best: list[tuple], beyond_noise: Callable) -> list[str]:
    if not picked_vs_best:
        return []
    worst, worst_key, picked, best = max(picked_vs_best, key=lambda t: t[0])
    slower = [t for t in picked_vs_best if beyond_noise(*t[:1], *t[2:])]
    return [
        f"- The backend `auto` picked, against the fastest single backend of the same row: time ratio at most "
        f"{worst:.2f} ({_name(worst_key)}, fastest there: `{best.backend}`): "
        + (
            f"slower beyond noise in: {'; '.join(f'{_name(k)} ({q:.2f})' for q, k, *_ in slower)}."
            if slower
            else "never slower beyond noise."
        )
    ]


def _large_groups_bullet(groups: dict[tuple, list[Result]]) -> list[str]:
    large = [(r.ratio, key) for key, rows in groups.items() for r in rows if r.auto and r.mean_rows >= LARGE_ROWS]
    if not large:
        return []
    below = [f"{_name(k)} ({q:.2f})" for q, k in sorted(large) if q < GOAL_RATIO]
    return [
        f"- `auto` throughput / dense where groups average >= {LARGE_ROWS} rows: {min(large)[0]:.2f} to "
        f"{max(large)[0]:.2f}; "
        + (
            f"below {GOAL_RATIO}x in {len(below)} of {len(large)}: {'; '.join(below)}."
            if below
            else f"at least {GOAL_RATIO}x in all {len(large)}."
        )
    ]


def _document(
    cases, settings: common.Settings, table: str, ceiling_table: str, summary: list[str], args, load: tuple
) -> str:
    extra = "".join(f" --case {c}" for c in args.case or []) + "".join(f" --dtype {d}" for d in args.dtype or [])
    extra += "".join(f" --gmm-backend {b}" for b in args.gmm_backend or [])
    command = f"epmoe bench gmm {settings.options()}{extra}"
    cases_table = _cases_table(cases, settings.seed)
    return f"""# Grouped matmul benchmark: `epmoe bench gmm`

Reproduce (from the repository root, after `pip install -e .`):

    {command}

- Machine: {common.machine_description(settings.device)}.
- Run: {datetime.date.today().isoformat()}, every candidate of a (case, dtype, pass) timed side by side,
  interleaved round by round; median of {settings.repeats} rounds after {settings.warmup} warm-up round(s).
- 1-minute load average at the start / end of the run: {_load(load[0])} / {_load(load[1])}
  (the run itself adds about its {settings.threads} threads at the end; more than that means other work shared the CPUs).

Each case is one rank's MoE experts after dispatch: `T` rows sorted by local expert, with counts
drawn from a seeded log-normal expert popularity (sigma {IMBALANCE}), through
`grouped_mm(x (T, D), weight (G, N, D), counts, trans_weight=True)`: the `nn.Linear` layout of
Hugging Face checkpoints, read without a copy. `gate_up` is `D=H, N=2I`, `down` is `D=I, N=H`.
`dense mm` is one `torch.mm` of the same FLOPs, `(T, D) @ (D, N)` with the `(D, N)` operand an
`(N, D)` weight transposed, as the grouped call reads it. `fwd+bwd` is the forward plus `dX` and
`dW` (3x the forward FLOPs) on both sides. `ratio to dense` = grouped FLOP/s / dense FLOP/s of the
same case, dtype and pass. `auto (x)` is `backend="auto"`, which ran backend `x`. `loop` is one
`torch.mm` per group, so its ratio is what per-group BLAS calls reach here; the gap from there to
dense is the BLAS's lower efficiency on G smaller products (fewer rows per call forward and for
`dX`, a contraction over only the group's rows for `dW`), not dispatch overhead.

## Cases

{cases_table}

## Results

{table}

## Per-call BLAS ceiling

Forward fp32, throughput of one `torch.mm` per group of `M` rows, each group with its own `(N, D)`
weight read transposed (as a grouped call reads them), over one `mm` of all `T` rows with one weight:
what any grouped matmul made of one BLAS call per group (ATen's CPU `grouped_mm`, the `loop` backend)
can reach at `M` rows per group. A group's weight is packed and streamed for only `M` rows of work.

{ceiling_table}

## Summary

{chr(10).join(summary)}
"""


def _cases_table(cases, seed: int) -> str:
    rows = []
    for case in cases:
        counts = case.counts(seed)
        dims = ", ".join(f"{p} {case.dims(p)[0]}x{case.dims(p)[1]}" for p in case.projections)
        mean = case.rows / case.num_experts
        rows.append(
            (case.name, case.model, case.num_experts, case.rows, f"{min(counts)} / {mean:.0f} / {max(counts)}", dims)
        )
    return common.markdown_table(
        ("case", "shape", "G", "rows T", "rows per group min / mean / max", "D x N"), rows, align="llrrll"
    )


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"
