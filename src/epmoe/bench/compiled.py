"""``epmoe bench layer --part compile``: ``torch.compile`` (default inductor) against eager, side by side.

    block   bench layer ep1's Qwen3-MoE block, forward + backward: epmoe and transformers' grouped_mm
            experts, each run eagerly and compiled
    step    bench layer ep2's 1-layer Qwen3-MoE model, forward + backward: epmoe at EP=1 (one process,
            nothing to exchange: traced whole) and at EP=2 (2 gloo ranks: the exchange runs eagerly
            behind one graph break per layer)

Each compiled copy has the eager copy's weights and is compiled (and checked against it: the largest
gradient difference over the eager gradient's largest magnitude) before timing, so compile time is
excluded. Graph breaks: ``torch._dynamo.explain`` of one forward, as graphs and distinct break sites.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

import epmoe
from epmoe.bench import blocks, common
from epmoe.launch import run_ranks
from epmoe.models import build_model

BLOCK_HEADERS = (
    "shape",
    "block",
    "eager ms",
    "compiled ms",
    "compiled / eager",
    "spread",
    "graphs",
    "break sites",
    "max grad diff",
)
STEP_HEADERS = (
    "model step",
    "eager ms",
    "compiled ms",
    "compiled / eager",
    "spread",
    "graphs",
    "break sites",
    "max grad diff",
)


@dataclass(frozen=True)
class Row:
    label: str
    eager_ms: float
    compiled_ms: float
    graphs: int
    sites: list[str]  # distinct graph-break sites, "reason (function)"
    grad_diff: float
    spread: float  # the larger (max - min) / median of the two timings

    def cells(self) -> tuple:
        sites = "; ".join(self.sites) if self.sites else "none"
        return (
            self.label,
            f"{self.eager_ms:.1f}",
            f"{self.compiled_ms:.1f}",
            f"{self.compiled_ms / self.eager_ms:.2f}",
            f"{self.spread:.0%}",
            self.graphs,
            sites,
            f"{self.grad_diff:.1e}",
        )


@dataclass
class CompileReport:
    blocks: list[tuple[str, Row]]  # (shape name, row)
    steps: list[Row]
    threads_per_rank: int

    def markdown(self) -> str:
        block_rows = [(shape, *row.cells()) for shape, row in self.blocks]
        lines = [
            "### torch.compile vs eager, fp32",
            "",
            common.markdown_table(BLOCK_HEADERS, block_rows, align="llrrrrrlr"),
            "",
            common.markdown_table(STEP_HEADERS, [row.cells() for row in self.steps], align="lrrrrrlr"),
            "",
        ]
        for row in self.steps:
            lines.append(f"- {row.label}: compiled step / eager step = {row.compiled_ms / row.eager_ms:.2f}")
        lines.append(
            f"- EP=2: {self.threads_per_rank} thread(s) per rank; the slowest rank's median (spread: rank 0's)"
        )
        return "\n".join(lines)


def run_compile(shapes, settings: common.Settings) -> CompileReport:
    """Every row of the report (see the module docstring)."""
    rows = []
    for shape in shapes:
        built = blocks.build_blocks(shape, settings.seed, settings.device)
        generator = torch.Generator().manual_seed(settings.seed + 1)
        x, dy = (torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(settings.device) for _ in "xy")
        for label in (blocks.EPMOE, blocks.GROUPED):
            rows.append((shape.name, compare_block(label, built[label], x, dy, settings)))

    threads = max(1, settings.threads // blocks.EP2_RANKS)
    shape = shapes[0]
    with tempfile.TemporaryDirectory(prefix="epmoe-bench-compile-") as path:
        build_model("qwen3_moe", seed=settings.seed, **blocks.ep2_model_kwargs(shape)).save_pretrained(path)
        ep1 = _model_rank(0, 1, path, shape.tokens, settings.warmup, settings.repeats, settings.seed)
        ep2 = run_ranks(
            _model_rank,
            blocks.EP2_RANKS,
            path,
            shape.tokens,
            settings.warmup,
            settings.repeats,
            settings.seed,
            threads_per_rank=threads,
            timeout=900,
        )
    steps = [
        _row("epmoe, EP=1, one process", ep1),
        _row(
            f"epmoe, EP=2, {blocks.EP2_RANKS} gloo ranks",
            ep2[0],
            slowest={name: max(statistics.median(r["samples"][name]) for r in ep2) for name in ep2[0]["samples"]},
            grad_diff=max(r["grad_diff"] for r in ep2),
        ),
    ]
    return CompileReport(rows, steps, threads)


def compare_block(
    label: str, block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, settings: common.Settings
) -> Row:
    """One block eager and compiled (a copy): graph breaks, gradients compared, then timed side by side."""
    graphs, sites = _explain(copy.deepcopy(block), x)
    compiled = torch.compile(copy.deepcopy(block))
    eager_step, compiled_step = blocks.block_step(block, x, dy), blocks.block_step(compiled, x, dy)
    compiled_step()
    compiled_grads = [p.grad for p in compiled.parameters()]
    eager_step()
    diff = _max_rel_diff(compiled_grads, [p.grad for p in block.parameters()])
    timings = common.measure(
        {"eager": eager_step, "compiled": compiled_step},
        warmup=settings.warmup,
        repeats=settings.repeats,
        device=settings.device,
    )
    return Row(
        label,
        1e3 * timings["eager"].median_s,
        1e3 * timings["compiled"].median_s,
        graphs,
        sites,
        diff,
        max(t.spread for t in timings.values()),
    )


def _model_rank(rank: int, world: int, path: str, tokens: int, warmup: int, repeats: int, seed: int) -> dict:
    """One rank (or the only process) of the model-step rows: an EP model eager and compiled."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    group = dist.group.WORLD if world > 1 else None
    models = {}
    for name in ("eager", "compiled"):
        models[name] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        epmoe.apply_expert_parallel(models[name], group)
    ids = torch.randint(
        0,
        models["eager"].config.vocab_size,
        (2, tokens // 2),
        generator=torch.Generator().manual_seed(seed + 1000 + rank),
    )
    graphs, sites = _explain(models["compiled"], ids)
    models["compiled"] = torch.compile(models["compiled"])
    steps = {name: _model_step(model, ids) for name, model in models.items()}
    grads = {}
    for name, step in steps.items():
        step()
        grads[name] = [p.grad for p in models[name].parameters() if p.grad is not None]
    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=world > 1)
    return {
        "samples": {name: list(t.samples_s) for name, t in timings.items()},
        "graphs": graphs,
        "sites": sites,
        "grad_diff": _max_rel_diff(grads["compiled"], grads["eager"]),
    }


def _model_step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def _row(label: str, result: dict, slowest: dict[str, float] | None = None, grad_diff: float | None = None) -> Row:
    seconds = slowest or {name: statistics.median(samples) for name, samples in result["samples"].items()}
    spread = max((max(samples) - min(samples)) / statistics.median(samples) for samples in result["samples"].values())
    return Row(
        label,
        1e3 * seconds["eager"],
        1e3 * seconds["compiled"],
        result["graphs"],
        result["sites"],
        result["grad_diff"] if grad_diff is None else grad_diff,
        spread,
    )


def _explain(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, list[str]]:
    """``(graphs, distinct break sites)`` of one forward of ``module``, from ``torch._dynamo.explain``."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(module)(x)
    sites = {
        f"{r.reason.splitlines()[0]} ({r.user_stack[-1].name if r.user_stack else '?'})"
        for r in explained.break_reasons
    }
    return explained.graph_count, sorted(sites)


def _max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if len(got) != len(want) or not want:
        raise RuntimeError(f"compiled and eager copies have {len(got)} and {len(want)} gradients")
    return max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(got, want)
    )
