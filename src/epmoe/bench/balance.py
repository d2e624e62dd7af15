"""Expert replicas against the other remedies for skewed routing: rows per rank, the slowest rank's step, exactness.

    epmoe bench balance [--quick] [--out benchmarks/balance_cpu.md]

Two gloo ranks (EP 2), one thread each, a one-layer Qwen3-MoE in float32 at a compute-bound shape
(H 512, I 1024, 8 experts, top-2, 512 tokens per rank; ``--quick``: H 64, I 128, 64 tokens). The
workloads are routers of the same model, each routing the same batches (:func:`gates`): the router's
weights with the part along the batch's mean hidden state ``u`` taken out, then ``beta_g u`` added
back, so that expert ``g``'s logits move by about ``beta_g`` (each token's by its own projection on
``u``)::

    uniform       beta = 0: the routing "happens to be balanced" (the limit)
    zipf          beta_g = -log(g + 1): expert g drawn about 1 / (g + 1) times as often (rank 0 holds the hot ones)
    hot expert    beta_0 set so that expert 0 gets 2.6x the mean routes
    hot rank      beta the same on rank 0's experts, set so that rank 0 computes 1.47x the mean rows
    recorded      beta_g = log of expert g's share of the routes of the demo's model (Qwen3-MoE, 8
                  experts, top-2) after 20 AdamW steps on the demo's batches, layer 0

For each, four EP arms of the same model on the same batches:

    without       ExpertParallelConfig(): today's path
    replicas      ExpertParallelConfig(replicas=2): hot experts' slots computed on the other rank too
    LoadBalancer  epmoe.LoadBalancer(update_rate=0.002) stepped for 60 steps first (its bias then
                  frozen): it changes which experts are picked
    capacity 1.0  ExpertParallelConfig(capacity_factor=1.0): each expert keeps its first T*K/E slots,
                  the rest dropped

and, per arm: the rows (routed pairs) each rank computed over the mean (``epmoe.expert_load(model,
computed=True)``), the share of slots dropped, the bytes handed to the other rank per step (tokens,
and of them the replicas' weights and their gradients: :func:`epmoe.comm.count_traffic`), the
exactness of one step against the unsharded model on every rank's batch (loss and every gradient,
the largest relative error: float32 rounding where exact), and the step (forward + backward, no
optimizer), timed side by side, the slowest rank's, the median over rounds. ``step / limit``: the
arm's step over the *limit*'s, the same model with the uniform router and without replicas (its
routing "happens to be balanced"), timed in the same rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

import epmoe
from epmoe.bench import common
from epmoe.comm import count_traffic
from epmoe.launch import run_ranks
from epmoe.models import build_model

RANKS = 2
REPLICAS = 2
BALANCE_RATE, BALANCE_STEPS = 0.002, 60
HOT_EXPERT, HOT_RANK = 2.6, 1.47  # the hot expert's routes, the hot rank's rows, over the mean
ARMS = {
    "without": {},
    "replicas": {"replicas": REPLICAS},
    "LoadBalancer": {},
    "capacity 1.0": {"capacity_factor": 1.0},
}
WORKLOADS = ("uniform", "zipf", "hot expert", "hot rank", "recorded")
BREAKDOWN = "hot rank"  # the workload whose replicas arm's time is taken apart by rank
LIMIT = "limit"  # the same model with the uniform router, without replicas: timed beside every workload's arms
HEADERS = (
    "workload",
    "arm",
    "rows max / mean",
    "dropped",
    "token MiB / step",
    "replica weights MiB / step",
    "error vs unsharded",
    "step ms",
    "spread",
    "step / limit",
    "step / without",
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    batch: int  # sequences per rank
    seq: int  # tokens per sequence

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SHAPE = Shape(hidden=512, intermediate=1024, experts=8, top_k=2, batch=4, seq=128)
QUICK = Shape(hidden=64, intermediate=128, experts=8, top_k=2, batch=2, seq=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # the common options only


def run(args: argparse.Namespace) -> int:
    settings = common.configure(args)
    shape = QUICK if settings.quick else SHAPE
    routers = {name: gate.tolist() for name, gate in gates(shape, settings.seed).items()}
    results = run_ranks(
        _rank,
        RANKS,
        shape,
        routers,
        settings.warmup,
        settings.repeats,
        settings.seed,
        threads_per_rank=1,
        timeout=3600,
    )
    command = f"epmoe bench balance {settings.options()}"
    text = markdown(shape, results[0], settings, command, common.load_average())
    if settings.out:
        Path(settings.out).write_text(text)
    print(text)
    return 0


# --------------------------------------------------------------------------------------------
# the workloads: one router per workload, the same model and batches


def model_of(shape: Shape) -> torch.nn.Module:
    return build_model(
        "qwen3_moe",
        num_experts=shape.experts,
        top_k=shape.top_k,
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.intermediate,
        num_hidden_layers=1,
    )


def batch(shape: Shape, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(0, 256, (shape.batch, shape.seq), generator=generator)


def gates(shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    """``{workload: the router's (E, H) weight}`` (see the module docstring), set on every rank's
    batches together (their hidden states at the router are the same for every workload)."""
    model = model_of(shape)
    router = model.model.layers[0].mlp.gate
    seen = []
    hook = router.register_forward_hook(lambda _m, inputs, _o: seen.append(inputs[0].detach()))
    with torch.no_grad():
        for rank in range(RANKS):
            model(batch(shape, rank, seed))
    hook.remove()
    h_TH = torch.cat(seen)
    u = h_TH.mean(0) / h_TH.mean(0).norm()
    scale = (h_TH @ u).mean()
    flat = router.weight.detach() - (router.weight.detach() @ u)[:, None] * u[None, :]

    def gate(beta_E: torch.Tensor) -> torch.Tensor:
        return flat + beta_E[:, None] * u[None, :] / scale

    def routes(beta_E: torch.Tensor) -> torch.Tensor:
        index = torch.topk(h_TH @ gate(beta_E).T, shape.top_k, dim=1).indices
        return torch.bincount(index.reshape(-1), minlength=shape.experts).double()

    E, e = shape.experts, shape.experts // RANKS
    on_rank0 = torch.tensor([1.0] * e + [0.0] * (E - e))
    on_expert0 = torch.tensor([1.0] + [0.0] * (E - 1))

    def hot_expert(b: float) -> float:  # expert 0's routes over the mean
        counts = routes(b * on_expert0)
        return (counts[0] * E / counts.sum()).item()

    def hot_rank(b: float) -> float:  # rank 0's rows over the mean
        counts = routes(b * on_rank0)
        return (counts[:e].sum() * RANKS / counts.sum()).item()

    recorded = _recorded_shares(shape)
    return {
        "uniform": gate(torch.zeros(E)),
        "zipf": gate(-torch.log(torch.arange(E, dtype=torch.float32) + 1)),
        "hot expert": gate(_solve(hot_expert, HOT_EXPERT) * on_expert0),
        "hot rank": gate(_solve(hot_rank, HOT_RANK) * on_rank0),
        "recorded": gate(torch.log(recorded / recorded.mean())),
    }


def _solve(ratio, target: float) -> float:
    """The ``beta`` in ``[0, 20]`` at which the increasing ``ratio(beta)`` crosses ``target`` (bisection)."""
    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _recorded_shares(shape: Shape) -> torch.Tensor:
    """``(E,)``: each expert's share of layer 0's routes in the demo's model (its family, ``E`` experts,
    top-``K``) after 20 AdamW steps on the demo's batches (one process, no EP)."""
    from epmoe.demo import synthetic_batch

    model = build_model("qwen3_moe", num_experts=shape.experts, top_k=shape.top_k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(20):
        ids = synthetic_batch(step, 0, 4, 64)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    routes = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))
    with torch.no_grad():
        for step in range(8):
            model(synthetic_batch(step, 0, 4, 64))
    hook.remove()
    counts = torch.bincount(torch.cat(routes).reshape(-1), minlength=shape.experts)
    return counts.clamp_min(1).float()


# --------------------------------------------------------------------------------------------
# one rank


def _rank(rank: int, world: int, shape: Shape, routers: dict, warmup: int, repeats: int, seed: int) -> dict:
    batches = [batch(shape, r, seed) for r in range(world)]
    limit = model_of(shape)
    with torch.no_grad():
        limit.model.layers[0].mlp.gate.weight.copy_(torch.tensor(routers["uniform"]))
    epmoe.apply_expert_parallel(limit)
    out = {}
    for workload in WORKLOADS:
        model = model_of(shape)
        with torch.no_grad():
            model.model.layers[0].mlp.gate.weight.copy_(torch.tensor(routers[workload]))
        reference = _reference(model, batches, rank)
        arms, steps, figures = {}, {}, {}
        for arm, options in ARMS.items():
            arms[arm] = copy.deepcopy(model)
            epmoe.apply_expert_parallel(arms[arm], config=options)
            if arm == "LoadBalancer":
                _balance(arms[arm], batches[rank])
            steps[arm] = _step(arms[arm], batches[rank])
            figures[arm] = _figures(arms[arm], steps[arm], reference)
        _sum_bytes_over_ranks(figures, world)
        steps[LIMIT] = _step(limit, batches[rank])  # timed in the same rounds: the machine's drift shared
        timings = common.measure(steps, warmup=warmup, repeats=repeats, ranks=True)
        for arm in ARMS:
            figures[arm]["ms"] = 1e3 * timings[arm].median_s
            figures[arm]["spread"] = timings[arm].spread
            figures[arm]["limit_ms"] = 1e3 * timings[LIMIT].median_s
        out[workload] = figures
        if workload == BREAKDOWN:
            out["breakdown"] = {arm: _breakdown(arms[arm], steps[arm], world) for arm in ("without", "replicas")}
    out["link"] = _link(shape, world)
    # what the replicas arms' cost model took: the flops per byte apply measured (one node: inside)
    out["link"]["applied"] = epmoe.ep_model(arms["replicas"]).links.inside
    return out


def _breakdown(model: torch.nn.Module, step, world: int) -> list[dict]:
    """Per rank, where 3 steps of ``model`` spend their time (``torch.profiler``, per step): the
    matmuls, the all-to-all-v exchanges (waiting for the other rank included), the whole step; and
    the rows the rank computed."""
    from torch.profiler import profile

    epmoe.reset_expert_load(model)
    step()
    (computed,) = epmoe.expert_load(model, computed=True).values()
    with profile() as prof:
        for _ in range(3):
            torch.distributed.barrier()
            step()
    self_ms = {}
    for event in prof.key_averages():
        self_ms[event.key] = self_ms.get(event.key, 0.0) + event.self_cpu_time_total / 1e3 / 3
    rank = torch.distributed.get_rank()
    mine = {
        "rows": int(computed[rank]),
        "mm": self_ms.get("aten::mm", 0.0),
        "exchange": sum(ms for key, ms in self_ms.items() if "all_to_all_v" in key or "alltoall" in key),
        "total": sum(self_ms.values()),
    }
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    return every


def _link(shape: Shape, world: int) -> dict:
    """What the cost model's exchange rate is made of, measured on these ranks: one rank's matmul
    flops per second at the experts' shape, and the bytes per second of an all-to-all-v that moves
    one expert's weights from one rank to the other."""
    import time

    x, w = torch.randn(1024, shape.hidden), torch.randn(shape.hidden, 2 * shape.intermediate)
    elements = 3 * shape.hidden * shape.intermediate
    rank = torch.distributed.get_rank()
    sent = torch.randn(elements if rank == 0 else 0)
    send, recv = ([0, elements], [0, 0]) if rank == 0 else ([0, 0], [elements, 0])
    mm, link = [], []
    for _ in range(12):
        start = time.perf_counter()
        x @ w
        mm.append(time.perf_counter() - start)
        torch.distributed.barrier()
        start = time.perf_counter()
        torch.distributed.all_to_all_single(torch.empty(sum(recv)), sent, recv, send)
        link.append(time.perf_counter() - start)
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[1] / statistics.median(mm[2:])
    link_bytes = elements * 4 / statistics.median(link[2:])
    return {"gflops": flops / 1e9, "gb_s": link_bytes / 1e9, "rho": flops / link_bytes}


def _sum_bytes_over_ranks(figures: dict, world: int) -> None:
    """Each arm's bytes as every rank handed the others together (the link's load, both directions)."""
    every = [None] * world
    mine = {arm: (f["token_mib"], f["weight_mib"]) for arm, f in figures.items()}
    torch.distributed.all_gather_object(every, mine)
    for arm, f in figures.items():
        f["token_mib"] = sum(rank[arm][0] for rank in every)
        f["weight_mib"] = sum(rank[arm][1] for rank in every)


def _reference(model: torch.nn.Module, batches: list[torch.Tensor], rank: int) -> dict:
    """The unsharded model on every rank's batch: this rank's loss, this rank's gradients of the
    parameters every rank holds, and the expert gradients summed over the ranks (what EP gives)."""
    ref = copy.deepcopy(model)
    grads, summed, loss = {}, {}, None
    for source, ids in enumerate(batches):
        ref.zero_grad(set_to_none=True)
        out = ref(ids, labels=ids)
        out.loss.backward()
        for name, param in ref.named_parameters():
            summed[name] = summed.get(name, 0) + param.grad
            if source == rank:
                grads[name] = param.grad.clone()
        if source == rank:
            loss = out.loss.detach()
    return {"loss": loss, "grads": grads, "summed": summed}


def _balance(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """``LoadBalancer`` stepped ``BALANCE_STEPS`` times on the batch (no parameter changes), then frozen."""
    balancer = epmoe.LoadBalancer(model, update_rate=BALANCE_RATE)
    for _ in range(BALANCE_STEPS):
        with torch.no_grad():
            model(ids)
        balancer.step()


def _step(model: torch.nn.Module, ids: torch.Tensor):
    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return step


def _figures(model: torch.nn.Module, step, reference: dict) -> dict:
    """One step of ``model``: its rows per rank over the mean, the dropped share, the bytes it handed
    the other rank, and its largest relative error against the unsharded model."""
    epmoe.reset_expert_load(model)
    with count_traffic() as traffic:
        loss = step()
    (computed,) = epmoe.expert_load(model, computed=True).values()
    (routed,) = epmoe.expert_load(model).values()
    (dropped,) = epmoe.expert_load(model, dropped=True).values()
    errors = [_rel(loss, reference["loss"])]
    for name, param in model.named_parameters():
        if epmoe.is_expert_parameter(param):
            e = param.shape[0]
            start = e * torch.distributed.get_rank()
            errors.append(_rel(param.grad, reference["summed"][name][start : start + e]))
        else:
            errors.append(_rel(param.grad, reference["grads"][name]))
    return {
        "rows": computed.max().item() * len(computed) / computed.sum().item(),
        "dropped": dropped.sum().item() / routed.sum().item(),
        "token_mib": (traffic.bytes_to_peers - traffic.replica_weight_bytes) / 2**20,
        "weight_mib": traffic.replica_weight_bytes / 2**20,
        "error": max(errors),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------
# the report


def _table(result: dict) -> list[tuple]:
    """The results table's rows: per workload and arm, the figures of the module docstring."""
    rows = []
    for workload in WORKLOADS:
        figures = result[workload]
        for arm, f in figures.items():
            rows.append(
                (
                    workload,
                    arm,
                    f"{f['rows']:.2f}",
                    f"{f['dropped']:.1%}",
                    f"{f['token_mib']:.2f}",
                    f"{f['weight_mib']:.2f}",
                    f"{f['error']:.1e}",
                    f"{f['ms']:.1f}",
                    f"{f['spread']:.2f}",
                    f"{f['ms'] / f['limit_ms']:.2f}",
                    f"{f['ms'] / figures['without']['ms']:.2f}",
                )
            )
    return rows


def markdown(shape: Shape, result: dict, settings: common.Settings, command: str, load: float | None) -> str:
    rows = _table(result)
    hot, uniform = result["hot rank"], result["uniform"]
    summary = (
        f"Under the hot-rank skew ({hot['without']['rows']:.2f}x the mean rows on one rank without replicas), "
        f"replicas bring it to {hot['replicas']['rows']:.2f}x and the slowest rank's step to "
        f"{hot['replicas']['ms'] / hot['replicas']['limit_ms']:.2f}x the balanced routing's "
        f"({hot['without']['ms'] / hot['without']['limit_ms']:.2f}x without: "
        f"{hot['replicas']['ms'] / hot['without']['ms']:.2f}x the step without replicas); on uniform routing "
        f"replicas take {uniform['replicas']['ms'] / uniform['without']['ms']:.2f}x the step without."
    )
    median_error = statistics.median(result[w]["replicas"]["error"] for w in WORKLOADS)
    link = result["link"]
    breakdown = [
        (arm, rank, r["rows"], f"{r['mm']:.1f}", f"{r['exchange']:.1f}", f"{r['total']:.1f}")
        for arm, ranks in result["breakdown"].items()
        for rank, r in enumerate(ranks)
    ]
    return "\n".join(
        [
            "# Expert replicas on skewed routing (`epmoe bench balance`)",
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {common.machine_description(settings.device)}; {RANKS} gloo ranks, 1 thread each"
            + (f"; load average at the end {load:.2f}" if load is not None else ""),
            "",
            f"Model: a one-layer Qwen3-MoE, float32, H {shape.hidden}, I {shape.intermediate}, {shape.experts} "
            f"experts, top-{shape.top_k}, {shape.tokens} tokens per rank, EP {RANKS}; replicas={REPLICAS}; "
            f"LoadBalancer update_rate={BALANCE_RATE} for {BALANCE_STEPS} steps first; the cost model's "
            f"{link['applied']:g} flops per link byte (measured when EP was applied).",
            "",
            summary,
            f"The replicas arm's largest error against the unsharded model, median over workloads: {median_error:.1e} "
            "(float32 rounding, as without replicas); the LoadBalancer and capacity arms change the model.",
            "",
            common.markdown_table(HEADERS, rows),
            "",
            f"Where the {BREAKDOWN} workload's step goes, per rank (torch.profiler, self CPU time per step; "
            "the exchanges include waiting for the other rank):",
            "",
            common.markdown_table(
                ("arm", "rank", "rows computed", "matmul ms", "all-to-all-v ms", "profiled ms"), breakdown
            ),
            "",
            f"The link, measured on these ranks: a matmul at the experts' shape runs {link['gflops']:.0f} GFLOP/s "
            f"per rank, an all-to-all-v moving one expert's weights {link['gb_s']:.2f} GB/s: "
            f"{link['rho']:.0f} flops per link byte (the cost model took {link['applied']:g}, measured when "
            f"EP was applied: epmoe.ep.links).",
            "",
            "Rows: the routed pairs each rank computed (replicas included) over the mean of the ranks. "
            "Token MiB: what the exchanges of both ranks handed the other per step (forward and backward: "
            "tokens, routes, outputs, gradients); replica weights MiB: the experts' weights sent to helpers and "
            "their gradients returned (not in the token column). Step: forward + backward, the slowest "
            "rank's, median over rounds; limit: the same model with the uniform router, without replicas, timed "
            "in the same rounds as the workload's arms.",
            "",
        ]
    )
