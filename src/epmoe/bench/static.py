"""Part ``static`` of ``epmoe bench layer``: the static exchange against the dynamic all-to-all-v.

Two gloo ranks on CPU, each with its own batch of a small Qwen3-MoE (both EP 2, ``check_steps``
off on both: no step-header exchange in either)::

    dynamic   dispatch="alltoallv": counts exchange (one host read per layer), then the rows, their
              expert ids and weights, and the combine by all-to-all-v of exactly the rows routed
    static    dispatch="static": fixed buffers of B rows per rank pair (B agreed at the first
              forward), no counts exchange and no host read (epmoe.ep.dispatch.static)
    static, headers read
              the same with check_steps on (decode steps only): the route headers read on every
              forward, one host read per layer, as dispatch="auto" runs generate's decode steps

A *decode step* is one forward of ``batch`` new tokens per rank (``use_cache=False``, no gradient:
the MoE layers' work of a decode step at that batch; the static buffer agreed on that batch,
``B = batch``), and one MoE layer alone on random routing of that batch, timed side by side, interleaved round by
round, the slowest rank's time per round, beside a bare all-to-all of ``COLLECTIVE_BYTES`` per peer;
then each step again with the time inside its collectives taken apart (:func:`collective_seconds`:
the floor of the ratio is the dynamic step less the share of its collectives the static exchange
leaves out). The counts per step (host reads: every ``Tensor.item /
tolist / cpu ...`` call in the step; collectives: every all-to-all of epmoe, the header exchanges
included) are divided by the model's MoE layers; a *training step* (forward and backward of the
same model on ``2 x 8`` tokens) is counted too.

The cost table: one experts module at EP 2 and 4, top-k 8 and 2, uniform random routing of ``T``
tokens per rank, forward and backward: the rows a rank's receive buffers hold (static: ``W x B``,
``B = T``) against the rows it receives (dynamic: one per token and rank holding one of its
experts), the bytes handed to other ranks (:func:`epmoe.comm.count_traffic`, padding included), the
step's peak memory (:func:`peak_bytes`: the most bytes the CPU allocator held at once during the
step above what it held before, as ``torch.profiler`` records every allocation and free: the sent
and received buffers, what autograd saves for backward, the gradients and workspace; the largest of
any rank), and the step's time (side by side, the slowest rank's; one thread per rank, the EP 4
ranks sharing the machine's cores).
"""

from __future__ import annotations

import copy
import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import epmoe
from epmoe.bench import common
from epmoe.comm import count_traffic
from epmoe.comm.steps import StepChannel
from epmoe.launch import run_ranks
from epmoe.models import build_model

MODES = {
    "dynamic": {"dispatch": "alltoallv", "check_steps": False},
    "static": {"dispatch": "static", "check_steps": False},
}
# the decode steps also with the route headers read on every forward: what dispatch="auto" runs at the
# decode steps of generate (epmoe.ep.dispatch.static.DecodeDispatcher)
DECODE_MODES = {**MODES, "static, headers read": {"dispatch": "static", "check_steps": True}}
COLLECTIVE_BYTES = 1024  # the bare all-to-all timed beside the steps (a decode step's route and rows: ~1 KiB)
DECODE_BATCHES = (1, 8)
RANKS = 2
GOAL = 0.7  # static / dynamic decode step at batch 1 <=
HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
COST_CASES = ((2, 8), (2, 2), (4, 8), (4, 2))  # (EP size, top-k)
DECODE_HEADERS = (
    "batch per rank",
    "mode",
    "step ms",
    "spread",
    "static / dynamic",
    "in collectives ms",
    "one MoE layer ms",
    "static / dynamic (layer)",
    "host reads per layer (step / layers)",
    "collectives per layer",
)
TRAIN_HEADERS = ("mode", "host reads per layer (fwd+bwd, step / layers)", "collectives per layer (fwd+bwd)")
COST_HEADERS = (
    "EP",
    "top-k",
    "T per rank",
    "rows received (dynamic)",
    "receive buffer rows (static, W x B)",
    "bytes to peers, dynamic",
    "bytes to peers, static",
    "static / dynamic bytes",
    "peak MiB, dynamic",
    "peak MiB, static",
    "static / dynamic memory",
    "step ms, dynamic",
    "step ms, static",
    "static / dynamic time",
)


@dataclass(frozen=True)
class Plan:
    hidden: int
    intermediate: int
    cost_tokens: int
    cost_experts: int


PLAN = Plan(hidden=256, intermediate=256, cost_tokens=512, cost_experts=32)
QUICK_PLAN = Plan(hidden=64, intermediate=64, cost_tokens=16, cost_experts=8)


def describe(quick: bool) -> str:
    plan = QUICK_PLAN if quick else PLAN
    return (
        f"- decode and training steps: Qwen3-MoE, 2 layers, H={plan.hidden}, I={plan.intermediate}, E=8, K=2, fp32\n"
        f"- cost: one experts module, H={plan.hidden}, I={plan.intermediate}, E={plan.cost_experts}, "
        f"T={plan.cost_tokens} per rank, fp32"
    )


@contextmanager
def counting():
    """``{"reads": n, "headers": n}`` counted inside the block: calls that hand a tensor's values to
    Python, and epmoe's step-header exchanges (the counts exchange among them)."""
    counts = {"reads": 0, "headers": 0}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    exchange = StepChannel.exchange

    def counted(original):
        def read(self, *args, **kwargs):
            counts["reads"] += 1
            return original(self, *args, **kwargs)

        return read

    def header(self, *args, **kwargs):
        counts["headers"] += 1
        return exchange(self, *args, **kwargs)

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    StepChannel.exchange = header
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        StepChannel.exchange = exchange


@contextmanager
def collective_seconds():
    """``{"s": seconds}`` spent inside ``torch.distributed.all_to_all_single`` in the block (every
    collective of epmoe's EP layers runs through it: counts, rows, routes, combine, static blocks)."""
    spent = {"s": 0.0}
    original = torch.distributed.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - start

    torch.distributed.all_to_all_single = timed
    try:
        yield spent
    finally:
        torch.distributed.all_to_all_single = original


def _time_in_collectives(steps: dict, repeats: int) -> dict:
    """``{mode: (step s, of it in collectives s)}``, means over ``repeats`` rounds of every step,
    interleaved, the ranks aligned by a barrier before each (this rank's own)."""
    spent = {mode: [0.0, 0.0] for mode in steps}
    for _ in range(repeats):
        for mode, step in steps.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            with collective_seconds() as inside:
                step()
            spent[mode][0] += (time.perf_counter() - start) / repeats
            spent[mode][1] += inside["s"] / repeats
    return {mode: tuple(times) for mode, times in spent.items()}


def _model(plan: Plan, **overrides) -> torch.nn.Module:
    return build_model("qwen3_moe", hidden_size=plan.hidden, moe_intermediate_size=plan.intermediate, **overrides)


def _decode_rank(rank: int, world: int, plan: Plan, warmup: int, repeats: int, seed: int) -> dict:
    """One rank: the decode steps of every mode timed side by side, with a bare all-to-all of
    ``COLLECTIVE_BYTES`` per peer, and the counts per step."""
    torch.manual_seed(seed)
    base = _model(plan).eval()
    layers = base.config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed + 100 + rank)
    out: dict = {"decode": {}, "train": {}, "layers": layers}
    sent, received = (
        torch.zeros(world * COLLECTIVE_BYTES, dtype=torch.uint8),
        torch.empty(world * COLLECTIVE_BYTES, dtype=torch.uint8),
    )
    for batch in DECODE_BATCHES:
        models = {}  # fresh per batch: the static buffer is agreed at the first forward, B = the batch
        for mode, config in DECODE_MODES.items():
            models[mode] = copy.deepcopy(base)
            epmoe.apply_expert_parallel(models[mode], config=config)
        ids = torch.randint(0, base.config.vocab_size, (batch, 1), generator=generator)

        def step(model=None, ids=ids):
            with torch.no_grad():
                model(ids, use_cache=False)

        steps = {mode: (lambda m=models[mode]: step(m)) for mode in DECODE_MODES}
        index = torch.rand(batch, base.config.num_experts, generator=generator).argsort(dim=1)[:, :2]
        x, weights = torch.randn(batch, plan.hidden, generator=generator), torch.rand(batch, 2, generator=generator)
        for mode, model in models.items():  # one MoE layer alone, on random routing of the same batch
            steps[mode, "layer"] = functools.partial(_layer_call, model.model.layers[0].mlp.experts, x, index, weights)
        for fn in steps.values():  # the static buffer's agreement happens here, before any count
            fn()
        steps["all-to-all"] = functools.partial(torch.distributed.all_to_all_single, received, sent)
        timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
        out["decode"][batch, "all-to-all"] = timings["all-to-all"]
        inside = _time_in_collectives({mode: steps[mode] for mode in DECODE_MODES}, repeats)
        for mode in DECODE_MODES:
            out["decode"][batch, mode, "collectives"] = inside[mode]
            with counting() as counts, count_traffic() as traffic:
                steps[mode]()
            out["decode"][batch, mode] = (
                timings[mode],
                counts["reads"] / layers,
                (counts["headers"] + traffic.exchanges) / layers,
            )
            out["decode"][batch, mode, "layer"] = timings[mode, "layer"]
    ids = torch.randint(0, base.config.vocab_size, (2, 8), generator=generator)
    for mode, config in MODES.items():
        model = copy.deepcopy(base).train()
        epmoe.apply_expert_parallel(model, config=config)
        model(ids, labels=ids).loss.backward()  # agreement, first-call logging
        with counting() as counts, count_traffic() as traffic:
            model(ids, labels=ids).loss.backward()
        out["train"][mode] = (counts["reads"] / layers, (counts["headers"] + traffic.exchanges) / layers)
    return out


def _layer_call(experts: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
    with torch.no_grad():
        experts(x, index, weights)


def _train_call(experts: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
    experts.zero_grad(set_to_none=True)
    experts(x.requires_grad_(), index, weights.requires_grad_()).sum().backward()


def peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once while ``fn()`` ran, above what it held before:
    every allocation and free ``torch.profiler`` records (``profile_memory``), summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, changes = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            changes.append((event.start_time_ns, event.typed[1].alloc_size))
    held = peak = 0
    for _, size in sorted(changes):
        held += size
        peak = max(peak, held)
    return peak


def _cost_rank(rank: int, world: int, plan: Plan, top_k: int, warmup: int, repeats: int, seed: int) -> dict:
    """One rank: one experts module's forward + backward on uniform random routing in both modes:
    the rows received, the static buffer's rows, the bytes to peers, and the step's time."""
    torch.manual_seed(seed)
    base = _model(plan, num_experts=plan.cost_experts, top_k=top_k, num_hidden_layers=1)
    T, E = plan.cost_tokens, plan.cost_experts
    generator = torch.Generator().manual_seed(seed + 200 + rank)
    index = torch.rand(T, E, generator=generator).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(T, top_k, generator=generator), dim=-1)
    hidden = torch.randn(T, plan.hidden, generator=generator)
    out, steps = {}, {}
    for mode, config in MODES.items():
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config={**config, **({"static_tokens": T} if mode == "static" else {})})
        steps[mode] = functools.partial(_train_call, model.model.layers[0].mlp.experts, hidden, index, weights)
        with count_traffic() as traffic:
            steps[mode]()
        out[mode] = traffic.bytes_to_peers
        out[mode, "peak"] = peak_bytes(steps[mode])
    timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
    out["ms"] = {mode: timing.median_s * 1e3 for mode, timing in timings.items()}
    per_rank = E // world
    every = [None] * world
    torch.distributed.all_gather_object(every, index.tolist())
    out["rows_received"] = sum(1 for theirs in every for t in theirs if any(e // per_rank == rank for e in t))
    out["buffer_rows"] = world * T
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, {mode: out.pop((mode, "peak")) for mode in MODES})
    out["peak"] = {mode: max(peak[mode] for peak in peaks) for mode in MODES}
    return out


@dataclass
class StaticReport:
    decode: dict  # (batch, mode) -> (Timing, host reads per layer, collectives per layer), slowest rank's timing;
    # (batch, mode, "layer") -> Timing of one MoE layer alone; (batch, "all-to-all") -> Timing of a bare one
    train: dict  # mode -> (host reads per layer, collectives per layer)
    layers: int  # MoE layers of the decode step's model
    cost: list  # rows of COST_HEADERS
    threads: int
    load: float | None  # the machine's load average after the timed runs

    def ratio(self, batch: int, mode: str = "static") -> float:
        return self.decode[batch, mode][0].median_s / self.decode[batch, "dynamic"][0].median_s

    def layer_ratio(self, batch: int, mode: str = "static") -> float:
        return self.decode[batch, mode, "layer"].median_s / self.decode[batch, "dynamic", "layer"].median_s

    def floor(self, batch: int) -> float:
        """The static / dynamic decode step ratio if the static exchange saved exactly the share of
        the dynamic step's time in collectives that its left-out collectives make (and cost nothing
        else): ``1 - (collectives left out / collectives) * time in collectives / step time``."""
        dynamic, static = self.decode[batch, "dynamic"], self.decode[batch, "static"]
        step_s, inside_s = self.decode[batch, "dynamic", "collectives"]
        return 1 - (dynamic[2] - static[2]) / dynamic[2] * inside_s / step_s

    def markdown(self) -> str:
        rows = []
        for batch in DECODE_BATCHES:
            for mode in DECODE_MODES:
                timing, reads, collectives = self.decode[batch, mode]
                layer = self.decode[batch, mode, "layer"]
                static = mode != "dynamic"
                step_s, inside_s = self.decode[batch, mode, "collectives"]
                rows.append(
                    (
                        batch,
                        mode,
                        f"{timing.median_s * 1e3:.3f}",
                        f"{timing.spread:.0%}",
                        f"{self.ratio(batch, mode):.2f}" if static else "",
                        f"{inside_s * 1e3:.3f} of {step_s * 1e3:.3f}",
                        f"{layer.median_s * 1e3:.3f}",
                        f"{self.layer_ratio(batch, mode):.2f}" if static else "",
                        f"{reads:g}",
                        f"{collectives:g}",
                    )
                )
        train = [(mode, f"{reads:g}", f"{collectives:g}") for mode, (reads, collectives) in self.train.items()]
        goal = self.ratio(1)
        verdict = "met" if goal <= GOAL else "NOT met"
        return (
            f"### Part static: decode steps at EP {RANKS} ({self.threads} threads per rank)\n\n"
            f"{common.markdown_table(DECODE_HEADERS, rows)}\n\n"
            f"Goal: static at most {GOAL}x dynamic at batch 1 (the whole decode step): {goal:.2f}x, {verdict} "
            f"(one MoE layer alone: {self.layer_ratio(1):.2f}x). Load average during the run: "
            f"{'unknown' if self.load is None else f'{self.load:.1f}'} (spread: (max - min) / median of the rounds)."
            f'\n\nWhere the time goes: "in collectives" is the time inside the step\'s all-to-alls (mean of '
            f"rounds timed again, ranks aligned before each step; this rank's), most of it waiting for the peer; "
            f"a bare all-to-all of {COLLECTIVE_BYTES} bytes per peer with the ranks aligned took "
            f"{self.decode[1, 'all-to-all'].median_s * 1e3:.3f} ms. Leaving out "
            f"{self.decode[1, 'dynamic'][2] - self.decode[1, 'static'][2]:g} of the dynamic path's "
            f"{self.decode[1, 'dynamic'][2]:g} collectives per layer saves at most that share of its time in "
            f"collectives: the floor of the ratio, {self.floor(1):.2f}x at batch 1 ({self.floor(8):.2f}x at batch 8)"
            f', were the static exchange\'s own work free. "static, headers read": the route headers read on '
            f'every forward (one host read per layer), what `dispatch="auto"` runs at the decode steps of '
            f"`generate`.\n\n"
            f"Training step (forward + backward, 2 x 8 tokens per rank):\n\n"
            f"{common.markdown_table(TRAIN_HEADERS, train)}\n\n"
            f"### Part static: cost of the fixed buffers (forward + backward of one layer, static_tokens = T)\n\n"
            f"{common.markdown_table(COST_HEADERS, self.cost)}"
        )


def run_static(settings: common.Settings) -> StaticReport:
    """Both tables of the part (see the module docstring)."""
    plan = QUICK_PLAN if settings.quick else PLAN
    threads = max(1, settings.threads // RANKS)
    results = run_ranks(
        _decode_rank,
        RANKS,
        plan,
        settings.warmup,
        settings.repeats,
        settings.seed,
        threads_per_rank=threads,
        timeout=1800,
    )
    decode = dict(results[0]["decode"])
    load = common.load_average()
    cost = []
    for world, top_k in COST_CASES:
        found = run_ranks(
            _cost_rank,
            world,
            plan,
            top_k,
            settings.warmup,
            settings.repeats,
            settings.seed,
            threads_per_rank=1,
            timeout=900,
        )
        mine, ms, peak = found[0], found[0]["ms"], found[0]["peak"]
        cost.append(
            (
                world,
                top_k,
                plan.cost_tokens,
                mine["rows_received"],
                mine["buffer_rows"],
                mine["dynamic"],
                mine["static"],
                f"{mine['static'] / mine['dynamic']:.2f}",
                f"{peak['dynamic'] / 2**20:.2f}",
                f"{peak['static'] / 2**20:.2f}",
                f"{peak['static'] / peak['dynamic']:.2f}",
                f"{ms['dynamic']:.1f}",
                f"{ms['static']:.1f}",
                f"{ms['static'] / ms['dynamic']:.2f}",
            )
        )
    return StaticReport(decode, results[0]["train"], results[0]["layers"], cost, threads, load)
