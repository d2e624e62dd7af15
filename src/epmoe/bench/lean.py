"""``epmoe bench layer --part lean``: what a layer keeps and sends, measured side by side.

Two shapes, each a ``Qwen3MoeSparseMoeBlock`` with random weights (its own router: softmax over the
``E`` experts, top-``K``, renormalised; SwiGLU experts): Qwen3-30B-A3B's (E=128, K=8, H=2048,
I=768) and a Mixtral-like one (E=8, K=2, I/H = 3.5 as Mixtral 8x7B's 14336/4096). Mixtral's own
block routes and computes the same way (softmax, top-2, renormalised, SwiGLU experts), so the Qwen3
class stands in for it with Mixtral's E, K and I/H. fp32 throughout.

1. Saved for backward at EP 1, elements per token: what autograd keeps in a forward of the block
   (the unique storages of its saved tensors, parameters excluded, in bytes over the element size,
   so an int64 index counts as two fp32 elements; ``torch.autograd.graph.saved_tensors_hooks``),
   for the epmoe block and transformers' ``grouped_mm`` block, next to what each design keeps for
   its experts::

       plain autograd (transformers' grouped_mm experts)   K(2H + 4I)
       Megatron-Core                                      K(H + 3I)
       Megatron-Core with moe_act recompute               K(H + 2I)
       SonicMoE                                           H + 2KI
       SonicMoE + the router's probabilities              H + 2KI + E   (the bound epmoe aims at)

   The measured blocks also keep their router's share (its input, its probabilities) and the
   routing indices and weights.
2. Bytes on the wire per token and step (forward + backward) at EP 2 and EP 4: W spawned gloo ranks
   on the CPU, each with its own tokens, routed by the block's router. epmoe: the bytes its
   all-to-all-v hands to other ranks, as ``epmoe.comm.count_traffic`` counts them (the rows' hidden
   states there and back, forward and backward, and each row's expert ids and routing weights).
   The per-slot layout (one row per (token, expert), what ``dispatch="fused"`` sends, through
   exchanges the counter does not see): computed from the same routing, each slot whose expert
   lives on another rank sending its H-row four times (dispatch, combine and their backward
   exchanges). ``d``: the mean number of ranks a token's experts span; epmoe sends a token to each
   of them but its own, the per-slot layout each of its ``K`` slots not on its own rank. Bytes do
   not depend on I: these runs use a small I.
3. The EP 1 step (the block's forward + backward), epmoe vs transformers' ``grouped_mm``,
   interleaved round by round. Goal: no slower beyond noise: **met** where epmoe's median time is
   at most ``grouped_mm``'s; **within noise** where it is above it but epmoe was not slower in every
   round (the rounds disagree); **not met** where it was slower in every round.
4. The EP 2 step at Qwen3-30B-A3B's proportions: two gloo ranks on the CPU, each with its own batch
   of a one-layer ``Qwen3MoeForCausalLM`` (small attention, vocabulary 256) whose MoE layer has
   E=128, K=8 and H, I halved (1024, 384: I/H = 0.375 kept) to stay within a 2-core, 24 GiB
   machine's memory and minutes (at full width each of the three variants holds 1.2 GB of expert
   weights and as much gradient per rank: 15 GB for two ranks before any activation or loading
   copy, and four times the FLOPs), saved with ``save_pretrained`` and loaded by every rank (as
   part ep2 does). A step is forward, backward and the gradient synchronisation, interleaved
   round by round::

       epmoe, all-to-all-v   apply_expert_parallel(model) (dispatch "auto" = "alltoallv"), then DDP
       epmoe, per-slot       the same with dispatch="fused", num_chunks=1 (the vendor ops' per-slot layout)
       transformers EP       from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))

   Goal: the all-to-all-v step at most 0.85x the per-slot step.

Parts 2 and 4 run on the CPU whatever ``--device`` says (gloo ranks).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

import epmoe
from epmoe import platform
from epmoe.bench import common
from epmoe.bench.blocks import (
    EPMOE,
    GROUPED,
    Shape,
    block_step,
    build_blocks,
    load_causal_lm,
    model_step,
    run_on_saved_model,
)
from epmoe.comm import count_traffic
from epmoe.launch import run_ranks

WIRE_RANKS = (2, 4)  # EP sizes of the wire measurement
STEP_RANKS = 2  # EP size of the step measurement
STEP_GOAL = 0.85  # epmoe all-to-all-v step / per-slot step <=
A2A, PER_SLOT, TRANSFORMERS_EP = "epmoe + DDP, all-to-all-v", "epmoe + DDP, per-slot", "transformers EP"
STEP_CONFIGS = {A2A: {"dispatch": "alltoallv"}, PER_SLOT: {"dispatch": "fused", "num_chunks": 1}}
STEP_NOTES = {
    A2A: "apply_expert_parallel (dispatch auto = alltoallv: each token once per rank holding its experts), then DDP",
    PER_SLOT: "apply_expert_parallel(config=dict(dispatch='fused', num_chunks=1)): one row per (token, expert); DDP",
    TRANSFORMERS_EP: "DistributedConfig(fsdp_size=2, ep_size=2), experts grouped_mm",
}

SAVED_HEADERS = ("shape", "kept for backward", "elements per token", "x epmoe's")
WIRE_HEADERS = (
    "shape",
    "EP",
    "tokens per rank",
    "d (ranks per token)",
    "epmoe measured B/token",
    "epmoe H-rows B/token",
    "per-slot B/token",
    "epmoe / per-slot",
)
EP1_STEP_HEADERS = ("shape", "variant", "step ms", "spread", "epmoe / this (rounds min-max)", "peak MiB above weights")
STEP_HEADERS = ("variant", "step ms", "spread", "loss - unsharded loss (max over ranks)", "note")


@dataclass(frozen=True)
class Plan:
    """The shapes part lean runs: ``shapes`` at EP 1 (saved elements, step time), the same with
    ``wire_intermediate`` and ``wire_tokens`` (per rank) for the wire bytes, ``step_shape`` at EP 2
    (``tokens``: per rank)."""

    shapes: tuple[Shape, ...]
    wire_intermediate: int
    wire_tokens: int
    step_shape: Shape

    def wire_shapes(self) -> tuple[Shape, ...]:
        return tuple(
            dataclasses.replace(s, intermediate=self.wire_intermediate, tokens=self.wire_tokens) for s in self.shapes
        )


PLAN = Plan(
    shapes=(
        Shape("Qwen3-30B-A3B", num_experts=128, top_k=8, hidden=2048, intermediate=768, tokens=512),
        Shape("Mixtral-like", num_experts=8, top_k=2, hidden=1024, intermediate=3584, tokens=1024),
    ),
    wire_intermediate=16,
    wire_tokens=512,
    step_shape=Shape(
        "Qwen3-30B-A3B proportions, H and I halved", num_experts=128, top_k=8, hidden=1024, intermediate=384, tokens=512
    ),
)
QUICK_PLAN = Plan(
    shapes=(
        Shape("tiny, K=8", num_experts=32, top_k=8, hidden=64, intermediate=24, tokens=64),
        Shape("tiny, K=2", num_experts=8, top_k=2, hidden=64, intermediate=224, tokens=64),
    ),
    wire_intermediate=8,
    wire_tokens=64,
    step_shape=Shape("tiny, K=8", num_experts=32, top_k=8, hidden=64, intermediate=24, tokens=64),
)


def run_lean(settings: common.Settings) -> LeanReport:
    """Every measurement of part lean (see the module docstring), in order."""
    plan = QUICK_PLAN if settings.quick else PLAN
    load_start = common.load_average()
    ep1 = [run_ep1(shape, settings) for shape in plan.shapes]
    wire = [row for ep_size in WIRE_RANKS for row in run_wire(plan.wire_shapes(), ep_size, settings)]
    step = run_step(plan.step_shape, settings)
    return LeanReport(plan, ep1, wire, step, (load_start, common.load_average()))


def describe(quick: bool) -> str:
    """The shapes of part lean, as markdown lines."""
    plan = QUICK_PLAN if quick else PLAN
    lines = [f"- {s.name}: {s.describe()}" for s in plan.shapes]
    lines.append(
        f"- wire bytes: the same E, K and H with I={plan.wire_intermediate}, {plan.wire_tokens} tokens "
        f"per rank, EP {' and '.join(map(str, WIRE_RANKS))}"
    )
    lines.append(f"- EP {STEP_RANKS} step: {plan.step_shape.name}: {plan.step_shape.describe()} per rank")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 1 and 3: saved elements and the step at EP 1


def kept_formulas(shape: Shape) -> list[tuple[str, int]]:
    """``(design: formula, elements per token)`` each design keeps for backward (module docstring)."""
    H, I, K, E = shape.hidden, shape.intermediate, shape.top_k, shape.num_experts
    return [
        ("plain autograd: K(2H + 4I)", K * (2 * H + 4 * I)),
        ("Megatron-Core: K(H + 3I)", K * (H + 3 * I)),
        ("Megatron-Core, moe_act recompute: K(H + 2I)", K * (H + 2 * I)),
        ("SonicMoE: H + 2KI", H + 2 * K * I),
        ("bound, SonicMoE + router probabilities: H + 2KI + E", H + 2 * K * I + E),
    ]


def saved_elements_per_token(block: torch.nn.Module, x_1TH: torch.Tensor, dy_1TH: torch.Tensor) -> float:
    """What autograd keeps in one forward of ``block`` on ``x_1TH``, in elements of its dtype per
    token: the unique storages of the saved tensors (parameters excluded), whole, bytes over the
    element size. The backward with ``dy_1TH`` then frees them (gradients set to ``None`` first)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved_bytes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved_bytes[storage.data_ptr()] = storage.nbytes()
        return t

    block.zero_grad(set_to_none=True)
    x_leaf = x_1TH.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x_leaf)
    torch.autograd.backward(out, dy_1TH)
    return sum(saved_bytes.values()) / x_1TH.shape[-2] / x_1TH.element_size()


def peak_step_bytes(block: torch.nn.Module, step: Callable[[], object], device: torch.device) -> int | None:
    """The most ``device`` memory allocated during ``step()`` above what was allocated before it
    (``block``'s gradients cleared first: its weights, the inputs and whatever else lives there
    excluded; activations, gradients and workspace included). ``None`` on the CPU."""
    module = platform.device_module(device.type)
    if module is None or not hasattr(module, "memory_allocated"):
        return None
    block.zero_grad(set_to_none=True)
    platform.synchronize(device)
    before = module.memory_allocated(device)
    platform.reset_peak_memory(device)
    step()
    platform.synchronize(device)
    return platform.peak_memory(device) - before


@dataclass
class Ep1Result:
    """One shape at EP 1: saved elements per token, step timings, peak memory (accelerators)."""

    shape: Shape
    saved: dict[str, float]  # variant -> elements saved per token, measured
    timings: dict[str, common.Timing]
    peak_bytes: dict[str, int | None]  # variant -> peak_step_bytes

    def saved_rows(self) -> list[tuple]:
        lean = self.saved[EPMOE]
        measured = [(f"{label} block, measured", value) for label, value in self.saved.items()]
        return [
            (self.shape.name, what, f"{value:.0f}", f"{value / lean:.2f}")
            for what, value in measured + kept_formulas(self.shape)
        ]

    def saved_lines(self) -> list[str]:
        over = self.saved[EPMOE] - kept_formulas(self.shape)[-1][1]
        return [
            f"- {self.shape.name}: epmoe keeps {over:+.0f} elements per token against the bound H + 2KI + E "
            f"({over / self.shape.top_k:+.1f} per routing choice: its indices and weights); transformers' "
            f"grouped_mm block keeps {self.saved[GROUPED] / self.saved[EPMOE]:.2f}x epmoe's"
        ]

    def round_ratios(self) -> list[float]:
        """epmoe's time over grouped_mm's, round by round (the rounds interleave them)."""
        return [a / b for a, b in zip(self.timings[EPMOE].samples_s, self.timings[GROUPED].samples_s)]

    def step_rows(self) -> list[tuple]:
        ratios = self.round_ratios()
        rows = []
        for label in (GROUPED, EPMOE):
            timing, peak = self.timings[label], self.peak_bytes[label]
            ratio = self.timings[EPMOE].median_s / timing.median_s
            span = f" ({min(ratios):.2f}-{max(ratios):.2f})" if label == GROUPED else ""
            rows.append(
                (
                    self.shape.name,
                    label,
                    f"{timing.median_s * 1e3:.1f}",
                    f"{timing.spread:.0%}",
                    f"{ratio:.2f}{span}",
                    "n/a (CPU)" if peak is None else f"{peak / 2**20:.0f}",
                )
            )
        return rows

    def step_verdict(self) -> str:
        ratio = self.timings[EPMOE].median_s / self.timings[GROUPED].median_s
        ratios = self.round_ratios()
        verdict = "met" if ratio <= 1 else ("within noise" if min(ratios) <= 1 else "not met")
        return (
            f"- {self.shape.name}: epmoe / transformers grouped_mm step = {ratio:.2f} (rounds "
            f"{min(ratios):.2f}-{max(ratios):.2f}; goal: no slower beyond noise): **{verdict}**"
        )


def run_ep1(shape: Shape, settings: common.Settings, dtype: torch.dtype = torch.float32) -> Ep1Result:
    """Saved elements per token, peak memory and interleaved step times of the epmoe and
    transformers grouped_mm blocks at EP 1."""
    device = settings.device
    blocks = build_blocks(shape, settings.seed, device, dtype, variants=(GROUPED, EPMOE))
    generator = torch.Generator().manual_seed(settings.seed + 1)
    x_1TH, dy_1TH = (torch.randn(1, shape.tokens, shape.hidden, generator=generator).to(device, dtype) for _ in "xy")
    saved = {label: saved_elements_per_token(block, x_1TH, dy_1TH) for label, block in blocks.items()}
    steps = {label: block_step(block, x_1TH, dy_1TH) for label, block in blocks.items()}
    peaks = {label: peak_step_bytes(blocks[label], steps[label], device) for label in blocks}
    timings = common.measure(steps, warmup=settings.warmup, repeats=settings.repeats, device=device)
    return Ep1Result(shape, saved, timings, peaks)


# ---------------------------------------------------------------------------------------------
# 2: bytes on the wire at EP 2 and EP 4


@dataclass
class WireRow:
    """One shape at one EP size, summed over its ranks."""

    shape: Shape
    ep_size: int
    tokens: int  # over all ranks
    spans: int  # over all tokens: the ranks each token's experts span
    measured_bytes: int  # epmoe, count_traffic, forward + backward
    row_bytes: int  # epmoe's rows to other ranks, their H-wide states four times (no expert ids / weights)
    per_slot_bytes: int  # the per-slot layout's slots to other ranks, H-wide, four times

    def cells(self) -> tuple:
        per_token = [b / self.tokens for b in (self.measured_bytes, self.row_bytes, self.per_slot_bytes)]
        return (
            self.shape.name,
            self.ep_size,
            self.tokens // self.ep_size,
            f"{self.spans / self.tokens:.2f}",
            *(f"{b:.0f}" for b in per_token),
            f"{self.measured_bytes / self.per_slot_bytes:.3f}",
        )


def run_wire(shapes: tuple[Shape, ...], ep_size: int, settings: common.Settings) -> list[WireRow]:
    """Each shape's wire bytes on ``ep_size`` spawned gloo ranks (one spawn for every shape)."""
    threads = max(1, settings.threads // ep_size)
    results = run_ranks(_wire_rank, ep_size, shapes, settings.seed, threads_per_rank=threads, timeout=600)
    rows = []
    for i, shape in enumerate(shapes):
        every = [result[i] for result in results]
        total = {key: sum(r[key] for r in every) for key in ("tokens", "spans", "measured", "rows", "slots")}
        row_bytes = 4 * shape.hidden * every[0]["element_size"]  # four exchanges of an H-wide row
        rows.append(
            WireRow(
                shape,
                ep_size,
                total["tokens"],
                total["spans"],
                total["measured"],
                total["rows"] * row_bytes,
                total["slots"] * row_bytes,
            )
        )
    return rows


def _wire_rank(rank: int, world: int, shapes: tuple[Shape, ...], seed: int) -> list[dict[str, int]]:
    """One rank of the wire measurement: each shape's epmoe block (EP size ``world``), one forward +
    backward of this rank's tokens under ``count_traffic``, and this rank's routing counted: the
    ranks each token's experts span, the rows and slots bound for other ranks."""
    results = []
    for shape in shapes:
        block = build_blocks(shape, seed, torch.device("cpu"), variants=(EPMOE,))[EPMOE]
        T, H, e = shape.tokens, shape.hidden, shape.num_experts // world
        generator = torch.Generator().manual_seed(seed + 1 + rank)
        x_1TH, dy_1TH = (torch.randn(1, T, H, generator=generator) for _ in "xy")
        with torch.no_grad():
            _, _, top_k_index_TK = block.gate(x_1TH.view(T, H))
        x_leaf = x_1TH.requires_grad_()
        with count_traffic() as traffic:
            torch.autograd.backward(block(x_leaf), dy_1TH)
        rank_TK = torch.div(top_k_index_TK, e, rounding_mode="floor")
        spans_TW = torch.zeros(T, world, dtype=torch.int64).scatter_(1, rank_TK, 1)
        results.append(
            {
                "tokens": T,
                "spans": int(spans_TW.sum()),
                "measured": traffic.bytes_to_peers,
                "rows": int(spans_TW.sum() - spans_TW[:, rank].sum()),  # epmoe's, to other ranks
                "slots": int((rank_TK != rank).sum()),  # the per-slot layout's, to other ranks
                "element_size": x_1TH.element_size(),
            }
        )
    return results


# ---------------------------------------------------------------------------------------------
# 4: the step at EP 2


@dataclass
class StepReport:
    """The EP 2 step: each variant's timing (each round the slowest rank's), first-loss parity."""

    shape: Shape
    threads_per_rank: int
    timings: dict[str, common.Timing]
    loss_diffs: dict[str, float]  # variant -> max over ranks of |first loss - unsharded loss|
    errors: dict[str, str]  # variant -> why it could not run
    exchanges: dict[str, common.Timing]  # A2A / PER_SLOT -> the four row exchanges of its layout, timed alone

    def rows(self) -> list[tuple]:
        rows = []
        for label, note in STEP_NOTES.items():
            if label in self.errors:
                rows.append((label, "-", "-", "-", f"did not run: {self.errors[label].strip().splitlines()[-1][:160]}"))
            else:
                timing = self.timings[label]
                rows.append(
                    (
                        label,
                        f"{timing.median_s * 1e3:.1f}",
                        f"{timing.spread:.0%}",
                        f"{self.loss_diffs[label]:.2e}",
                        note,
                    )
                )
        return rows

    def verdicts(self) -> list[str]:
        t = self.timings
        ratios = [a / b for a, b in zip(t[A2A].samples_s, t[PER_SLOT].samples_s)]
        ratio = t[A2A].median_s / t[PER_SLOT].median_s
        lines = [
            f"- epmoe all-to-all-v step / per-slot step = {ratio:.2f} (rounds {min(ratios):.2f}-"
            f"{max(ratios):.2f}; goal <= {STEP_GOAL}): **{'met' if ratio <= STEP_GOAL else 'not met'}**"
        ]
        if TRANSFORMERS_EP in t:
            lines.append(
                f"- epmoe all-to-all-v step / transformers EP step = "
                f"{t[A2A].median_s / t[TRANSFORMERS_EP].median_s:.2f}"
            )
        per_slot, lean = self.exchanges[PER_SLOT].median_s, self.exchanges[A2A].median_s
        floor = (t[PER_SLOT].median_s - (per_slot - lean)) / t[PER_SLOT].median_s
        lines.append(
            f"- what the bytes are worth here: the per-slot layout's four row exchanges of this step's routing, "
            f"timed alone on these ranks (`all_to_all_single`, slowest rank), take {per_slot * 1e3:.1f} ms, "
            f"epmoe's {lean * 1e3:.1f} ms; the per-slot step without that difference would be {floor:.2f}x "
            f"itself: the floor of the ratio from the bytes alone on this machine"
            + (
                f", above the goal of {STEP_GOAL}: beyond what loopback gloo lets the bytes save"
                if floor > STEP_GOAL
                else ""
            )
        )
        return lines


def run_step(shape: Shape, settings: common.Settings) -> StepReport:
    """Save a one-layer Qwen3-MoE model of ``shape``'s experts, then time its EP 2 step variants."""
    results, threads = run_on_saved_model(_step_rank, STEP_RANKS, shape, settings)
    errors = results[0]["errors"]
    loss_diffs = {
        label: max(abs(r["losses"][label] - r["losses"]["unsharded"]) for r in results)
        for label in results[0]["timings"]
    }
    return StepReport(shape, threads, results[0]["timings"], loss_diffs, errors, results[0]["exchanges"])


def _step_rank(rank: int, world: int, path: str, tokens: int, warmup: int, repeats: int, seed: int) -> dict:
    """One rank of the EP 2 step: load the variants, check their first loss, time them side by side."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    generator = torch.Generator().manual_seed(seed + 1000 + rank)
    reference = load_causal_lm(path)
    ids = torch.randint(0, reference.config.vocab_size, (2, tokens // 2), generator=generator)
    routed = []  # the MoE layer's top-k index on this rank's batch, from its router's output
    hook = reference.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: routed.append(out[-1]))
    with torch.no_grad():
        losses = {"unsharded": reference(ids, labels=ids).loss.item()}
    hook.remove()
    rows = _rows_to_peer(routed[0], reference.config.num_experts // world, rank, world)
    hidden = reference.config.hidden_size
    steps, errors = {}, {}
    for label, config in STEP_CONFIGS.items():
        model = copy.deepcopy(reference)
        epmoe.apply_expert_parallel(model, config=config)
        steps[label] = model_step(DDP(model), ids)
    del reference, model
    gc.collect()
    try:
        from transformers.distributed import DistributedConfig

        hf = load_causal_lm(path, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world))
        steps[TRANSFORMERS_EP] = model_step(hf, ids)
        losses[TRANSFORMERS_EP] = steps[TRANSFORMERS_EP]()
    except Exception:  # noqa: BLE001 - report why their path could not run, keep measuring ours
        errors[TRANSFORMERS_EP] = traceback.format_exc()
        steps.pop(TRANSFORMERS_EP, None)
    failed = [None] * world
    dist.all_gather_object(failed, sorted(errors))
    if any(f != failed[0] for f in failed):
        raise RuntimeError(f"ranks disagree on which variants failed: {failed}")
    for label in STEP_CONFIGS:
        losses[label] = steps[label]()
    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
    exchanges = common.measure(
        {label: _row_exchanges(n, hidden, world) for label, n in rows.items()},
        warmup=warmup,
        repeats=repeats,
        ranks=True,
    )
    return {"losses": losses, "timings": timings, "errors": errors, "exchanges": exchanges}


def _rows_to_peer(top_k_index_TK: torch.Tensor, experts_per_rank: int, rank: int, world: int) -> dict[str, int]:
    """The H-rows this rank sends the other ranks per exchange: epmoe's (one per token and other rank
    its experts live on) and the per-slot layout's (one per slot whose expert is on another rank)."""
    rank_TK = torch.div(top_k_index_TK, experts_per_rank, rounding_mode="floor")
    spans_TW = torch.zeros(rank_TK.shape[0], world, dtype=torch.int64).scatter_(1, rank_TK, 1)
    return {A2A: int(spans_TW.sum() - spans_TW[:, rank].sum()), PER_SLOT: int((rank_TK != rank).sum())}


def _row_exchanges(rows_to_peer: int, hidden: int, world: int) -> Callable[[], None]:
    """Four ``all_to_all_single`` of fp32 rows of width ``hidden``, ``rows_to_peer`` to every other rank
    (what a layer's dispatch, combine and their backward exchanges move), as one timed call; every
    rank learns the others' counts first."""
    import torch.distributed as dist

    counts = [None] * world
    dist.all_gather_object(counts, rows_to_peer)
    rank = dist.get_rank()
    send = [0 if r == rank else rows_to_peer for r in range(world)]
    receive = [0 if r == rank else counts[r] for r in range(world)]
    x = torch.randn(sum(send), hidden)
    out = x.new_empty(sum(receive), hidden)

    def exchanges() -> None:
        for _ in range(4):
            dist.all_to_all_single(out, x, receive, send)

    return exchanges


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class LeanReport:
    plan: Plan
    ep1: list[Ep1Result]
    wire: list[WireRow]
    step: StepReport
    load: tuple[float | None, float | None]  # 1-minute load average at the start and the end

    def markdown(self) -> str:
        step = self.step
        lines = [
            "### Lean data path: saved for backward at EP 1, elements per token",
            "",
            common.markdown_table(SAVED_HEADERS, [r for result in self.ep1 for r in result.saved_rows()], align="llrr"),
            "",
        ]
        lines += [line for result in self.ep1 for line in result.saved_lines()]
        lines += [
            "- measured rows: the whole block (router included); formula rows: the experts (the bound adds "
            "the router's E probabilities); one int64 index counts as two fp32 elements",
            "",
            f"### Lean data path: bytes on the wire per token and step (forward + backward), EP "
            f"{' and '.join(map(str, WIRE_RANKS))}",
            "",
            common.markdown_table(WIRE_HEADERS, [row.cells() for row in self.wire], align="lrrrrrrr"),
            "",
            f"- the block's own router with random weights (std 0.02: routing close to uniform); "
            f"I={self.plan.wire_intermediate} (bytes do not depend on I); fp32 (4 B per element)",
            "- epmoe measured: `count_traffic`, what its all-to-all-v hands to other ranks; epmoe H-rows: its "
            "rows bound for other ranks (one per token and other rank its experts live on) x 4H from the "
            "routing, the rest of the measured bytes being each row's K expert ids and K weights (fp32) "
            "forward and their gradient's exchange backward",
            "",
            "### Lean data path: EP 1 step (block forward + backward), epmoe vs transformers grouped_mm",
            "",
            common.markdown_table(
                EP1_STEP_HEADERS, [r for result in self.ep1 for r in result.step_rows()], align="llrrrr"
            ),
            "",
        ]
        lines += [result.step_verdict() for result in self.ep1]
        lines += [
            "",
            f"### Lean data path: EP {STEP_RANKS} step, {STEP_RANKS} gloo ranks, one-layer Qwen3-MoE "
            f"({step.shape.describe()} per rank), {step.threads_per_rank} thread(s) per rank",
            "",
            common.markdown_table(STEP_HEADERS, step.rows(), align="lrrrl"),
            "",
        ]
        lines += step.verdicts()
        lines.append("- every round's time is the slowest rank's; spread: (max - min) / median over the rounds")
        for label, error in step.errors.items():
            lines += ["", f"{label} failed with:", "", "    " + "\n    ".join(error.strip().splitlines()[-12:])]
        start, end = (f"{v:.2f}" if v is not None else "n/a" for v in self.load)
        lines += ["", f"- 1-minute load average at the start / end of the part: {start} / {end}"]
        return "\n".join(lines)
