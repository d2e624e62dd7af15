"""``epmoe bench layer``: a Qwen3-MoE block, forward+backward, epmoe vs transformers' experts and EP.

Part ``ep1``, one process, EP size 1. One ``Qwen3MoeSparseMoeBlock`` (the model's own router and
packed experts) in three copies with identical weights, timed side by side on the same input and
output gradient::

    transformers eager        config._experts_implementation = "eager"       (per-expert loop)
    transformers grouped_mm   config._experts_implementation = "grouped_mm"  (one sort, torch grouped_mm)
    epmoe                     epmoe.apply_expert_parallel(block), no process group
    dense floor               the experts' GEMM FLOPs as two plain dense torch.mm, forward + dX + dW

One step is the block's forward and backward (input, router and expert weights all get gradients,
set to ``None`` first as ``zero_grad`` does). ``eager`` is 5-30x slower than the others, so it is
timed in a short pass of its own, interleaved with epmoe, and compared with that pass's epmoe time.
Where the epmoe step goes: its grouped matmuls measured inside the step (``torch.profiler`` over a
few steps: the time of epmoe's grouped matmuls (``epmoe.gmm.forward`` / ``epmoe.gmm.backward`` in the profile), over the
profiled steps' wall time), the share outside them; then the grouped matmuls, the router and the
SwiGLU each timed on its own (same counts, forward and backward), reported as their time against the
step's, not as shares of it (alone, with their own caches, they need not add up to the step).

Part ``ep2``, two gloo ranks on CPU, each with its own batch of a one-layer ``Qwen3MoeForCausalLM``
whose MoE layer has the first shape's experts, saved with ``save_pretrained`` and loaded by every rank::

    epmoe + DDP        apply_expert_parallel(model), then DistributedDataParallel(model)
    transformers EP    from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))
    replicated + DDP   no EP: every rank holds all experts; DistributedDataParallel (plain data parallel)

A step is forward, backward and the gradient synchronisation, interleaved round by round. Then the
same EP and replicated models each train through ``transformers.Trainer`` (the EP one through
``epmoe.prepare_trainer``) for the same number of steps, timed per step by a callback: a Trainer
step also clips the gradients and runs AdamW. Loss parity: each interleaved variant's first loss on
each rank against the unsharded model's on that rank's batch; the EP Trainer's logged losses
against the replicated Trainer's.

Part ``compile``: ``torch.compile`` against eager, the block and the model step
(:mod:`epmoe.bench.compiled`).

Part ``lean``: the lean data path side by side at Qwen3-30B-A3B's and a Mixtral-like shape: what a
block keeps for backward, the bytes on the wire at EP 2 and EP 4, the EP 1 and EP 2 steps
(:mod:`epmoe.bench.lean`).

Part ``static``: ``dispatch="static"`` against ``"alltoallv"``: decode steps at EP 2, host reads and
collectives per layer, the fixed buffers' cost in memory and on the wire (:mod:`epmoe.bench.static`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

import epmoe
from epmoe import platform
from epmoe.bench import common, lean, static
from epmoe.bench.blocks import (
    DENSE,
    EAGER,
    EP2_LAYERS,
    EP2_RANKS,
    EPMOE,
    GROUPED,
    QUICK_SHAPES,
    SHAPES,
    Shape,
    block_step,
    build_blocks,
    load_causal_lm,
    model_step,
    run_on_saved_model,
)
from epmoe.bench.compiled import run_compile
from epmoe.demo import step_times
from epmoe.ep.state import ep_states
from epmoe.gmm import grouped_mm
from epmoe.gmm.registry import PROFILED_BACKWARD, PROFILED_FORWARD

PARTS = ("ep1", "ep2", "compile", "lean", "static")
EP1_HEADERS = ("shape", "variant", "time ms", "expert GFLOP/s", "epmoe time / this")
SPLIT_HEADERS = ("shape", "part of the epmoe step", "time ms", "share of the step (in it) / time vs the step (alone)")
PROFILED_STEPS = 3  # epmoe steps profiled for the in-step share of its grouped matmuls
GMM_FUNCTIONS = (PROFILED_FORWARD, PROFILED_BACKWARD)  # epmoe's grouped matmuls, in profiles
EP2_HEADERS = ("variant", "step ms", "loss - unsharded loss (max over ranks)", "note")
GOALS = {"grouped_mm": 0.85, "eager": 0.3, "dense": 0.7}  # epmoe/grouped_mm <=, epmoe/eager <=, dense/epmoe >=
EAGER_REPEATS = 2  # rounds of the eager pass (eager takes seconds to tens of seconds per step on a CPU)


EPMOE_DDP, REPLICATED_DDP = "epmoe + DDP", "replicated (no EP) + DDP"
EPMOE_UNCHECKED = "epmoe + DDP, check_steps=False"
EPMOE_BALANCED = "epmoe + DDP + expert_load + LoadBalancer"
EPMOE_TRAINER, REPLICATED_TRAINER = "epmoe, Trainer", "replicated (no EP), Trainer"
TRAINER_VARIANTS = (EPMOE_TRAINER, REPLICATED_TRAINER)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part",
        action="append",
        choices=PARTS,
        help="run only this part (repeatable; default: all). ep1: one process, EP size 1; "
        "ep2: 2 gloo ranks on CPU; compile: torch.compile vs eager (block, EP=1 and EP=2 steps); "
        "lean: the lean data path (saved per token, wire bytes at EP 2 and 4, EP 1 and EP 2 "
        "steps) at Qwen3-30B-A3B and Mixtral-like shapes; static: dispatch='static' against "
        "'alltoallv' (decode steps at EP 2, host reads and collectives, buffer and wire cost)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("epmoe bench layer needs transformers v5 (pip install 'epmoe[models]')") from None
    settings = common.configure(args)
    parts = args.part or list(PARTS)
    shapes = QUICK_SHAPES if settings.quick else SHAPES
    sections = []
    if "ep1" in parts:
        ep1 = Ep1Report([run_ep1(shape, settings) for shape in shapes])
        print(ep1.markdown() + "\n")
        sections.append(ep1)
    if "ep2" in parts:
        ep2 = run_ep2(shapes[0], settings)
        print(ep2.markdown() + "\n")
        sections.append(ep2)
    if "compile" in parts:
        report = run_compile(shapes, settings)
        print(report.markdown() + "\n")
        sections.append(report)
    if "lean" in parts:
        report = lean.run_lean(settings)
        print(report.markdown() + "\n")
        sections.append(report)
    if "static" in parts:
        report = static.run_static(settings)
        print(report.markdown() + "\n")
        sections.append(report)
    if settings.out:
        with open(settings.out, "w") as out:
            out.write(_document(shapes, settings, parts, sections))
        print(f"\nwrote {settings.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# Part ep1: one block, EP size 1


@dataclass
class Ep1Result:
    shape: Shape
    timings: dict[str, common.Timing]
    counts: list[int]
    max_rel_diff: dict[str, float]  # variant -> max relative difference to eager (output and all grads)
    gemm_share_in_step: float | None  # the grouped matmuls' share of the epmoe step, profiled inside it

    def rows(self) -> list[tuple]:
        rows = []
        for label in (EAGER, GROUPED, EPMOE, DENSE):
            seconds = self.timings[label].median_s
            rows.append(
                (
                    self.shape.name,
                    label,
                    f"{seconds * 1e3:.1f}",
                    f"{self.shape.flops / seconds / 1e9:.1f}",
                    f"{self.epmoe_over(label):.2f}",
                )
            )
        return rows

    def epmoe_over(self, label: str) -> float:
        """epmoe's time over ``label``'s, both from the same interleaved pass."""
        epmoe = self.timings["epmoe (eager pass)" if label == EAGER else EPMOE].median_s
        return epmoe / self.timings[label].median_s

    def split_rows(self) -> list[tuple]:
        total, share = self.timings[EPMOE].median_s, self.gemm_share_in_step
        rows = []
        if share is not None:
            rows += [
                (
                    self.shape.name,
                    "grouped matmuls (gate_up + down, fwd + bwd), in the step",
                    share * total,
                    f"{share:.0%}",
                ),
                (self.shape.name, "outside the grouped matmuls, in the step", (1 - share) * total, f"{1 - share:.0%}"),
            ]
        for name, key in (
            ("grouped matmuls, timed alone", "gemm"),
            ("router (gate fwd + bwd), timed alone", "router"),
            ("SwiGLU (fwd + bwd), timed alone", "swiglu"),
        ):
            seconds = self.timings[key].median_s
            rows.append((self.shape.name, name, seconds, f"{seconds / total:.2f}x"))
        return [(shape, name, f"{seconds * 1e3:.1f}", share) for shape, name, seconds, share in rows]

    def goals(self) -> list[str]:
        t = {k: v.median_s for k, v in self.timings.items()}
        checks = [
            ("epmoe / transformers grouped_mm time", self.epmoe_over(GROUPED), "<=", GOALS["grouped_mm"]),
            ("epmoe / transformers eager time", self.epmoe_over(EAGER), "<=", GOALS["eager"]),
            ("dense floor / epmoe time (fraction of the floor reached)", t[DENSE] / t[EPMOE], ">=", GOALS["dense"]),
        ]
        lines = []
        for what, value, op, goal in checks:
            met = value <= goal if op == "<=" else value >= goal
            verdict = "met" if met else "not met"
            lines.append(f"- {self.shape.name}: {what} = {value:.2f} (goal {op} {goal}): **{verdict}**")
        if self.gemm_share_in_step is not None:
            lines.append(
                f"- {self.shape.name}: share of the epmoe step outside its grouped matmuls = "
                f"{1 - self.gemm_share_in_step:.0%} (profiled inside the step)"
            )
        return lines


def run_ep1(shape: Shape, settings: common.Settings, dtype: torch.dtype = torch.float32) -> Ep1Result:
    """Time the block variants, the dense floor and the parts of the epmoe step, side by side."""
    device, seed = settings.device, settings.seed
    blocks = build_blocks(shape, seed, device, dtype)
    generator = torch.Generator().manual_seed(seed + 1)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, dtype)

    T, H, I, S, E = shape.tokens, shape.hidden, shape.intermediate, shape.rows, shape.num_experts
    x_1TH, dy_1TH = randn(1, T, H), randn(1, T, H)
    with torch.no_grad():
        _, _, top_k_index_TK = blocks[EPMOE].gate(x_1TH.view(T, H))
    counts = torch.bincount(top_k_index_TK.reshape(-1).cpu(), minlength=E).tolist()
    max_rel_diff = _parity(blocks, x_1TH, dy_1TH)

    fns: dict[str, Callable[[], object]] = {label: block_step(block, x_1TH, dy_1TH) for label, block in blocks.items()}
    experts = blocks[EPMOE].experts
    # Dense floor: the same FLOPs, nn.Linear-layout weights read transposed as the grouped calls read them.
    x_SH, h_SI, dgu_S2I, dd_SH = randn(S, H), randn(S, I), randn(S, 2 * I), randn(S, H)
    w_gu, w_d = randn(2 * I, H) * H**-0.5, randn(H, I) * I**-0.5
    fns[DENSE] = _gemm_step(lambda x, w: x @ w.t(), (x_SH, h_SI), (w_gu, w_d), (dgu_S2I, dd_SH))
    fns["gemm"] = _gemm_step(
        lambda x, w: grouped_mm(x, w, counts, trans_weight=True),
        (x_SH, h_SI),
        (experts.gate_up_proj.detach(), experts.down_proj.detach()),
        (dgu_S2I, dd_SH),
    )
    fns["router"] = _router_step(blocks[EPMOE].gate, x_1TH.view(T, H), randn(T, shape.top_k))
    fns["swiglu"] = _swiglu_step(experts, randn(S, 2 * I), randn(S, I))
    eager = fns.pop(EAGER)
    timings = common.measure(fns, warmup=settings.warmup, repeats=settings.repeats, device=device)
    # eager is 5-30x slower than the rest: its own short pass, interleaved with epmoe (already warm: _parity ran it)
    eager_pass = common.measure(
        {EAGER: eager, EPMOE: fns[EPMOE]}, warmup=0, repeats=min(settings.repeats, EAGER_REPEATS), device=device
    )
    timings[EAGER] = eager_pass[EAGER]
    timings["epmoe (eager pass)"] = eager_pass[EPMOE]
    return Ep1Result(shape, timings, counts, max_rel_diff, _gemm_share_in_step(fns[EPMOE], device))


def _gemm_share_in_step(step: Callable[[], object], device: torch.device) -> float | None:
    """The share of ``step``'s wall time spent in epmoe's grouped matmuls (its custom ops, forward and
    backward: CPU time on the CPU, the kernels they launch on CUDA), from ``torch.profiler``
    over :data:`PROFILED_STEPS` steps."""
    from torch.profiler import ProfilerActivity, profile

    if device.type not in ("cpu", "cuda"):
        return None  # the profiler's kernel times are read on cpu and cuda only
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        platform.synchronize(device)
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            step()
        platform.synchronize(device)
        wall = time.perf_counter() - start
    inside = (
        sum(e.device_time_total if cuda else e.cpu_time_total for e in prof.key_averages() if e.key in GMM_FUNCTIONS)
        * 1e-6
    )
    return inside / wall


def _gemm_step(mm, xs, weights, dys) -> Callable[[], None]:
    """Forward ``mm(x, w)`` for each pair and backward to every ``x`` and ``w``."""
    leaves = [t.detach().clone().requires_grad_() for t in (*xs, *weights)]
    n = len(xs)

    def step() -> None:
        outs = [mm(x, w) for x, w in zip(leaves[:n], leaves[n:])]
        torch.autograd.grad(outs, leaves, dys)

    return step


def _router_step(gate: torch.nn.Module, x_TH: torch.Tensor, dw_TK: torch.Tensor) -> Callable[[], None]:
    weight = gate.weight

    def step() -> None:
        x_leaf = x_TH.detach().requires_grad_()
        _, top_k_weights, _ = gate(x_leaf)
        torch.autograd.grad(top_k_weights, (x_leaf, weight), dw_TK)

    return step


def _swiglu_step(experts: torch.nn.Module, h_S2I: torch.Tensor, dy_SI: torch.Tensor) -> Callable[[], None]:
    h_leaf = h_S2I.detach().clone().requires_grad_()

    def step() -> None:
        torch.autograd.grad(experts._apply_gate(h_leaf), h_leaf, dy_SI)

    return step


def _parity(blocks: dict[str, torch.nn.Module], x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    """Max relative difference to the eager block over the output and every gradient, per variant."""

    def results(block: torch.nn.Module) -> list[torch.Tensor]:
        block.zero_grad(set_to_none=True)
        x_leaf = x.detach().requires_grad_()
        out = block(x_leaf)
        torch.autograd.backward(out, dy)
        return [out.detach(), x_leaf.grad] + [p.grad for _, p in sorted(block.named_parameters())]

    reference = results(blocks[EAGER])
    diffs = {}
    for label in (GROUPED, EPMOE):
        diffs[label] = max(
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(results(blocks[label]), reference)
        )
        blocks[label].zero_grad(set_to_none=True)
    blocks[EAGER].zero_grad(set_to_none=True)
    return diffs


@dataclass
class Ep1Report:
    results: list[Ep1Result]

    def markdown(self) -> str:
        rows = [row for result in self.results for row in result.rows()]
        split_rows = [row for result in self.results for row in result.split_rows()]
        lines = [
            "### EP size 1: one MoE block, forward + backward",
            "",
            common.markdown_table(EP1_HEADERS, rows, align="llrrr"),
            "",
            "### Where the epmoe step goes",
            "",
            common.markdown_table(SPLIT_HEADERS, split_rows, align="llrr"),
            "",
            "### Goals",
            "",
        ]
        for result in self.results:
            lines += result.goals()
        lines.append("")
        for result in self.results:
            diffs = ", ".join(f"{k} {v:.1e}" for k, v in result.max_rel_diff.items())
            spread = max(t.spread for t in result.timings.values())
            lines.append(
                f"- {result.shape.name}: rows per expert min / mean / max = {min(result.counts)} / "
                f"{result.shape.rows / result.shape.num_experts:.0f} / {max(result.counts)}; max relative "
                f"difference to eager (output and all grads): {diffs}; largest timing spread "
                f"(max-min)/median {spread:.0%}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Part ep2: two gloo ranks, epmoe vs transformers' expert parallelism


@dataclass
class Ep2Report:
    shape: Shape
    tokens_per_rank: int
    threads_per_rank: int
    steps_ms: dict[str, float]  # variant -> step time, median over rounds, slowest rank
    loss_diffs: dict[str, float]  # variant -> max over ranks of |loss - unsharded loss|
    losses: list[dict[str, float]]  # per rank: variant -> first loss (and "unsharded")
    errors: dict[str, str]  # variant -> why it could not run
    dispatch: str  # the dispatch epmoe resolved ("alltoallv" or "fused")
    trainer_drift: dict[str, float]  # Trainer variant -> max over its steps of |loss - replicated Trainer loss|
    trainer_steps: int
    count_load_us: float  # the forward's telemetry: one layer's count_load, microseconds
    balancer_ms: float  # expert_load + reset + LoadBalancer.step, timed inside the step (slowest rank)

    def markdown(self) -> str:
        notes = {
            EPMOE_DDP: f"apply_expert_parallel (dispatch {self.dispatch}), then DDP; step headers in backward "
            f"(check_steps='auto': on for CPU)",
            EPMOE_UNCHECKED: "the same without the backward step headers (the forward's ride in the counts)",
            EPMOE_BALANCED: "epmoe + DDP, then every step expert_load, reset_expert_load and LoadBalancer.step",
            "transformers EP": "DistributedConfig(fsdp_size=2, ep_size=2), experts grouped_mm",
            REPLICATED_DDP: "all experts on every rank; DDP",
            EPMOE_TRAINER: "Trainer step (fwd, bwd, clip, AdamW), prepare_trainer; first loss vs replicated Trainer",
            REPLICATED_TRAINER: "Trainer step (fwd, bwd, clip, AdamW), all experts on every rank",
        }
        rows = []
        for label in notes:
            if label in self.errors:
                rows.append((label, "-", "-", f"did not run: {self.errors[label].splitlines()[0][:160]}"))
            elif label in self.steps_ms:
                rows.append((label, f"{self.steps_ms[label]:.1f}", f"{self.loss_diffs[label]:.2e}", notes[label]))
        lines = [
            f"### EP size 2: {EP2_RANKS} gloo ranks, {EP2_LAYERS}-layer Qwen3-MoE, {self.tokens_per_rank} tokens "
            f"per rank, {self.threads_per_rank} thread(s) per rank",
            "",
            common.markdown_table(EP2_HEADERS, rows, align="lrrl"),
            "",
        ]
        for mine, theirs, what in (
            (EPMOE_DDP, "transformers EP", "epmoe + DDP step / transformers EP step"),
            (EPMOE_DDP, REPLICATED_DDP, "epmoe + DDP step / replicated + DDP step"),
            (EPMOE_DDP, EPMOE_UNCHECKED, "backward step headers on / off (cost of check_steps)"),
            (EPMOE_BALANCED, EPMOE_DDP, "with / without telemetry reads and the balancer"),
            (EPMOE_TRAINER, REPLICATED_TRAINER, "epmoe Trainer step / replicated Trainer step"),
        ):
            if mine in self.steps_ms and theirs in self.steps_ms:
                lines.append(f"- {what} = {self.steps_ms[mine] / self.steps_ms[theirs]:.2f}")
        if EPMOE_DDP in self.steps_ms:
            share = self.count_load_us * 1e-3 * EP2_LAYERS / self.steps_ms[EPMOE_DDP]
            lines.append(
                f"- forward-side telemetry (counting each layer's slots, always on): {self.count_load_us:.1f} us "
                f"per layer forward = {100 * share:.4f}% of the epmoe + DDP step"
            )
        if EPMOE_BALANCED in self.steps_ms:
            lines.append(
                f"- expert_load + reset_expert_load + LoadBalancer.step, timed inside the step: "
                f"{self.balancer_ms:.2f} ms = {100 * self.balancer_ms / self.steps_ms[EPMOE_BALANCED]:.2f}% "
                f"of it (the step-time ratio above is within the rounds' spread)"
            )
        if EPMOE_TRAINER in self.trainer_drift:
            lines.append(
                f"- epmoe Trainer loss vs replicated Trainer loss, max over {self.trainer_steps} steps: "
                f"{self.trainer_drift[EPMOE_TRAINER]:.2e} (fp32 rounding, grown by AdamW)"
            )
        for rank, losses in enumerate(self.losses):
            lines.append(f"- rank {rank} losses: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
        for label, error in self.errors.items():
            lines += ["", f"{label} failed with:", "", "    " + "\n    ".join(error.strip().splitlines()[-12:])]
        return "\n".join(lines)


def run_ep2(shape: Shape, settings: common.Settings) -> Ep2Report:
    """Save a small Qwen3-MoE model, then time and check every EP=2 variant on 2 gloo ranks."""
    results, threads = run_on_saved_model(_ep2_rank, EP2_RANKS, shape, settings)
    errors = results[0]["errors"]
    labels = [label for label in results[0]["times"] if label not in errors]
    steps_ms = {label: 1e3 * max(statistics.median(r["times"][label]) for r in results) for label in labels}
    losses = [r["losses"] for r in results]
    loss_diffs = {
        label: max(abs(r[label] - r["unsharded"]) for r in losses) for label in labels if label not in TRAINER_VARIANTS
    }
    trainer_drift = {}
    for label in TRAINER_VARIANTS:
        mine, ref = (results[0]["trainer_losses"][v] for v in (label, REPLICATED_TRAINER))
        loss_diffs[label] = abs(mine[0] - ref[0])
        trainer_drift[label] = max(abs(a - b) for a, b in zip(mine, ref))
    return Ep2Report(
        shape,
        shape.tokens,
        threads,
        steps_ms,
        loss_diffs,
        losses,
        errors,
        results[0]["dispatch"],
        trainer_drift,
        len(results[0]["trainer_losses"][EPMOE_TRAINER]),
        max(r["count_load_us"] for r in results),
        max(r["balancer_ms"] for r in results),
    )


def _ep2_rank(rank: int, world: int, path: str, tokens: int, warmup: int, repeats: int, seed: int) -> dict:
    """One rank of part ep2: load the variants, check their first loss, time their steps side by side."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    generator = torch.Generator().manual_seed(seed + 1000 + rank)
    reference = load_causal_lm(path)
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (2, tokens // 2), generator=generator)
    with torch.no_grad():
        losses = {"unsharded": reference(ids, labels=ids).loss.item()}

    steps: dict[str, Callable[[], float]] = {}
    errors: dict[str, str] = {}
    model = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(model)
    dispatch = sorted({state.transport.name for _, _, state in ep_states(model)})
    steps[EPMOE_DDP] = model_step(DDP(model), ids)
    unchecked = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(unchecked, config={"check_steps": False})
    steps[EPMOE_UNCHECKED] = model_step(DDP(unchecked), ids)
    balanced = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(balanced)
    balancer_seconds: list[float] = []
    steps[EPMOE_BALANCED] = model_step(
        DDP(balanced), ids, epmoe.LoadBalancer(balanced, update_rate=1e-3), balancer_seconds
    )
    steps[REPLICATED_DDP] = model_step(DDP(copy.deepcopy(reference)), ids)
    _add_transformers_ep(path, world, ids, steps, losses, errors)
    failed = [None] * world
    dist.all_gather_object(failed, sorted(errors))
    if any(f != failed[0] for f in failed):
        raise RuntimeError(f"ranks disagree on which variants failed: {failed}")
    losses[EPMOE_DDP] = steps[EPMOE_DDP]()
    losses[EPMOE_UNCHECKED] = steps[EPMOE_UNCHECKED]()
    losses[EPMOE_BALANCED] = steps[EPMOE_BALANCED]()
    losses[REPLICATED_DDP] = steps[REPLICATED_DDP]()

    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
    times = {name: list(timing.samples_s) for name, timing in timings.items()}
    trainer_losses = {}
    for label in TRAINER_VARIANTS:
        net = copy.deepcopy(reference)
        if label == EPMOE_TRAINER:
            epmoe.apply_expert_parallel(net)
        seconds, trainer_losses[label] = _trainer_steps(net, label == EPMOE_TRAINER, tokens, warmup + repeats, seed)
        times[label] = seconds[warmup:]
    return {
        "losses": losses,
        "times": times,
        "errors": errors,
        "dispatch": "/".join(dispatch),
        "trainer_losses": trainer_losses,
        "count_load_us": _count_load_us(model, tokens),
        "balancer_ms": 1e3 * statistics.median(balancer_seconds[-repeats:]),
    }


def _add_transformers_ep(path: str, world: int, ids: torch.Tensor, steps: dict, losses: dict, errors: dict) -> None:
    """transformers' own EP as one more variant of part ep2, or why it could not run."""
    try:
        from transformers.distributed import DistributedConfig

        hf = load_causal_lm(path, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world))
        steps["transformers EP"] = model_step(hf, ids)
        losses["transformers EP"] = steps["transformers EP"]()
    except Exception:  # noqa: BLE001 - report why their path could not run, keep measuring ours
        errors["transformers EP"] = traceback.format_exc()
        steps.pop("transformers EP", None)


def _count_load_us(model: torch.nn.Module, tokens: int) -> float:
    """Microseconds per call of the load telemetry's count (the first experts module's counters)."""
    state = next(state for _, _, state in ep_states(model))
    counts = [tokens // state.shard.num_experts] * state.shard.num_local_experts
    start = time.perf_counter()
    for _ in range(10_000):
        state.loads.count(counts)
    return (time.perf_counter() - start) / 10_000 * 1e6


def _trainer_steps(model: torch.nn.Module, prepare: bool, tokens: int, steps: int, seed: int):
    """``(seconds per step, logged losses)`` of ``steps`` steps of ``transformers.Trainer`` on ``model``
    (2 rows of ``tokens // 2`` per rank and step, AdamW, max_grad_norm=1.0)."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(seed + 2000)
    rows = torch.randint(0, model.config.vocab_size, (4 * steps, tokens // 2), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    with tempfile.TemporaryDirectory(prefix="epmoe-bench-trainer-") as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            seed=seed,
            dataloader_num_workers=0,
        )
        timer = step_times(torch.device("cpu"))
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)
        if prepare:
            epmoe.prepare_trainer(trainer)
        trainer.train()
    return timer.times, [h["loss"] for h in trainer.state.log_history if "loss" in h]


# ---------------------------------------------------------------------------------------------
# The results document


def _markdown(docstring: str) -> str:
    """A reST-flavoured docstring as markdown: single backticks, ``::`` blocks as indented code."""
    return docstring.replace("``", "`").replace("::\n", ":\n")


def _allocator_env() -> list[str]:
    """glibc malloc tunables and preloaded allocators set (``NAME=value``): on a CPU they move these
    timings a lot, so the reproduce command sets them too."""
    return [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"]


def _document(shapes, settings: common.Settings, parts: list[str], sections: list) -> str:
    """The results file: how to reproduce them, the machine, what the parts run measure, their shapes,
    the results."""
    import transformers

    extra = "".join(f" --part {p}" for p in parts) if parts != list(PARTS) else ""
    command = " ".join([*_allocator_env(), f"epmoe bench layer {settings.options()}{extra}"])
    described, shape_lines = [], []
    if set(parts) - {"lean", "static"}:
        described += [
            _markdown(__doc__.split(chr(10), 2)[2].strip()),
            f"Goals: epmoe at most {GOALS['grouped_mm']}x transformers' `grouped_mm` time, at most "
            f"{GOALS['eager']}x\n`eager`, and at least {GOALS['dense']} of the dense floor's speed.",
        ]
        shape_lines += [f"- {s.name}: {s.describe()}; expert GEMMs {s.flops / 1e9:.1f} GFLOP per step" for s in shapes]
    if "lean" in parts:
        described.append(_markdown(lean.__doc__.strip()))
        shape_lines.append(("\nPart lean:\n\n" if shape_lines else "") + lean.describe(settings.quick))
    if "static" in parts:
        described.append(_markdown(static.__doc__.strip()))
        shape_lines.append(("\nPart static:\n\n" if shape_lines else "") + static.describe(settings.quick))
    body = "\n\n".join(section.markdown() for section in sections)
    description = "\n\n".join(described)
    shape_text = "\n".join(shape_lines)
    return f"""# MoE layer benchmark: `epmoe bench layer`

Reproduce (from the repository root, after `pip install -e '.[models]'`):

    {command}

- Machine: {common.machine_description(settings.device)}; transformers {transformers.__version__};
  allocator settings in the environment: {", ".join(f"`{f}`" for f in _allocator_env()) or "none (glibc defaults)"}.
- Run: {datetime.date.today().isoformat()}. Within a shape every variant is timed side by side, interleaved round by
  round (order rotated each round); median of {settings.repeats} rounds after {settings.warmup} warm-up round(s).
  EP=2: every rank times each step between two barriers; the slowest rank's median is shown.

{description}

## Shapes

{shape_text}

## Results

{body}
"""
