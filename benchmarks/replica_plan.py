"""One rank's host bookkeeping of a layer call with expert replicas, the implementation at a git ref against this one.

    python benchmarks/replica_plan.py [--old 7a8d239] [--repeats 7] [--out benchmarks/replica_plan_cpu.md]

Everything a rank computes on the host from the slot matrix ``slots_WE`` (every rank's slots per
global expert, from the counts exchange) in one layer call with ``ExpertParallelConfig(replicas=N)``:
the plan (``plan_replicas``), the telemetry's moved slots, the weight exchange's splits, the moves
its own source redirects, its local experts' and replicas' counts, and the transport's splits: the
per-rank exchange's (``send_W``, ``recv_W``) or the two-level exchange's (``NodeSplits``, ``P = 8``
ranks per node). The new side calls the functions the layer and the transports call; the old side
loads ``epmoe/ep/replicas.py`` and the two-level exchange's ``_replica_splits`` from ``--old`` (``git
show``) and runs the lines the layer and the per-rank exchange ran there (:func:`_old_per_rank`).

Slot matrices: ``W`` ranks of ``1024`` tokens, top-8 (distinct experts per token) over ``E = 256``
experts, drawn uniformly or Zipf-like (expert ``g`` with weight ``1 / (g + 1)``, relabelled at
random), ``N = 2`` replicas per helper, every imbalance worth a move (the cost model's ``least`` at
0 on every link: the most moves); the new side plans as a layer call does, its ranks on nodes of
``P`` (a helper on the owner's node first at equal load: one more heap per node), after checking that
without nodes it makes the old side's moves. Each time is the slowest of three ranks (the most loaded, the one that helps
most, rank 0), each the median of ``--repeats`` rounds (``epmoe.bench.common.measure``), the old
side's calls interleaved among themselves, then the new side's (apart: neither runs amid the other's
memory traffic, the slot matrix warm as a layer call finds it, just read from the counts exchange).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from epmoe.bench.common import load_average, machine_description, markdown_table, measure
from epmoe.ep.counts import LayerCounts, NodeSplits
from epmoe.ep.dispatch import alltoallv, nodes
from epmoe.ep.replicas import plan_replicas

ROOT = Path(__file__).resolve().parent.parent
WORLDS = (8, 32, 64, 128, 256)
EXPERTS, TOKENS, TOP_K, REPLICAS, RANKS_PER_NODE = 256, 1024, 8, 2, 8
LOADS = {"uniform": 0.0, "zipf": 1.0}  # name -> the exponent of expert g's weight 1 / (g + 1)^s


def slot_matrix(W: int, skew: float, seed: int = 0) -> list[list[int]]:
    """``(W, E)``: the slots each of ``W`` ranks sends each expert (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    weight_E = 1.0 / (torch.randperm(EXPERTS, generator=g) + 1.0) ** skew
    rows = []
    for _ in range(W):
        index_TK = torch.multinomial(weight_E.expand(TOKENS, EXPERTS), TOP_K, replacement=False, generator=g)
        rows.append(torch.bincount(index_TK.reshape(-1), minlength=EXPERTS).tolist())
    return rows


def layer_counts(slots_WE: list[list[int]], rank: int, P: int) -> LayerCounts:
    """What the counts exchange hands ``rank`` that the replica bookkeeping reads: its rows to and
    from each rank (here the slots, capped at the tokens) and its two-level splits (likewise)."""
    W, e = len(slots_WE), EXPERTS // len(slots_WE)
    rows_WW = [[min(TOKENS, sum(row[r * e : (r + 1) * e])) for r in range(W)] for row in slots_WE]
    node, rail = rank // P, range(rank % P, W, P)
    splits = NodeSplits(
        [min(TOKENS, sum(rows_WW[rank][n * P : (n + 1) * P])) for n in range(W // P)],
        [min(TOKENS, sum(rows_WW[s][node * P : (node + 1) * P])) for s in rail],
        [sum(rows_WW[s][node * P + j] for s in rail) for j in range(P)],
        [sum(rows_WW[s][rank] for s in range(W) if s % P == j) for j in range(P)],
    )
    return LayerCounts(
        send_counts_WE=[],
        recv_counts_WE=[],
        local_counts_e=[],
        group=None,
        global_slots=0,
        send_rows_W=rows_WW[rank],
        recv_rows_W=[rows_WW[s][rank] for s in range(W)],
        peer_guards=None,
        slots_WE=slots_WE,
        nodes=splits,
    )


def new_plan(slots_WE: list[list[int]], e: int):
    """The plan as a layer call makes it: every link free, the ranks on nodes of ``RANKS_PER_NODE``
    (a helper on the owner's node first at equal load)."""
    nodes_W = [r // RANKS_PER_NODE for r in range(len(slots_WE))]
    return plan_replicas(slots_WE, e, REPLICAS, 0, between=0, nodes_W=nodes_W)


def _new_per_rank(counts: LayerCounts, rank: int, e: int) -> None:
    plan = new_plan(counts.slots_WE, e)
    plan.moved_W(), plan.lending(rank), plan.local_counts(rank)
    alltoallv._replica_splits(counts, plan, rank), plan.moves_from(rank)


def _new_two_level(counts: LayerCounts, rank: int, e: int) -> None:
    plan = new_plan(counts.slots_WE, e)
    plan.moved_W(), plan.lending(rank), plan.local_counts(rank)
    nodes._replica_splits(counts.nodes, plan, rank, RANKS_PER_NODE), plan.moves_from(rank)


def _old_per_rank(old, counts: LayerCounts, rank: int, e: int) -> None:
    """The old layer's and per-rank exchange's lines (``layer._lend``, ``AllToAllVDispatcher._with_replicas``)."""
    plan = old.plan_replicas(counts.slots_WE, e, REPLICAS, 0)
    plan.moved_W()
    W = plan.ep_size
    sent, received = plan.sent(rank), plan.received(rank)
    [sum(m.helper == r for m in sent) for r in range(W)], [sum(m.owner == s for m in received) for s in range(W)]
    [m.expert - rank * e for m in sent]
    redirected_W = plan.redirected_rows_W(rank)
    [a + b for a, b in zip(counts.send_rows_W, redirected_W)]
    [counts.recv_rows_W[s] + plan.redirected_rows_W(s)[rank] for s in range(W)]
    plan.moves_from(rank, e), plan.local_counts(rank)


def _old_two_level(old, old_splits, counts: LayerCounts, rank: int, e: int) -> None:
    """The old layer's lines and two-level exchange's (``NodesDispatcher._with_replicas``)."""
    plan = old.plan_replicas(counts.slots_WE, e, REPLICAS, 0)
    plan.moved_W()
    W = plan.ep_size
    sent, received = plan.sent(rank), plan.received(rank)
    [sum(m.helper == r for m in sent) for r in range(W)], [sum(m.owner == s for m in received) for s in range(W)]
    [m.expert - rank * e for m in sent]
    old_splits(counts.nodes, plan, rank, RANKS_PER_NODE)
    plan.moves_from(rank, 0), sum(plan.redirected_rows_W(rank)), plan.local_counts(rank)


def load_old(ref: str):
    """``(replicas module, the two-level exchange's _replica_splits)`` as they were at ``ref``."""

    def show(path: str) -> str:
        git = ["git", "show", f"{ref}:{path}"]
        return subprocess.run(git, cwd=ROOT, check=True, capture_output=True, text=True).stdout

    spec = importlib.util.spec_from_loader("old_replicas", loader=None)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_replicas"] = old  # dataclasses look their module up
    exec(compile(show("src/epmoe/ep/replicas.py"), f"{ref}:replicas.py", "exec"), old.__dict__)
    tree = ast.parse(show("src/epmoe/ep/dispatch/nodes.py"))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_replica_splits")
    namespace = {"NodeSplits": NodeSplits}
    exec(compile(ast.Module([function], []), f"{ref}:nodes.py", "exec"), namespace)
    return old, namespace["_replica_splits"]


def run(ref: str, repeats: int) -> list[list[object]]:
    old, old_splits = load_old(ref)
    rows = []
    for W in WORLDS:
        e = EXPERTS // W
        for load, skew in LOADS.items():
            slots_WE = slot_matrix(W, skew)
            plan = plan_replicas(slots_WE, e, REPLICAS, 0)
            moves = [(m.expert, m.owner, m.helper, m.start, m.stop) for m in plan.moves]
            was = [
                (m.expert, m.owner, m.helper, m.start, m.stop)
                for m in old.plan_replicas(slots_WE, e, REPLICAS, 0).moves
            ]
            assert moves == was, f"W={W} {load}: the plans differ"
            routed_W = [sum(plan.load_E[r * e : (r + 1) * e]) for r in range(W)]
            helped_W = [len(plan.received(r)) for r in range(W)]
            ranks = sorted({max(range(W), key=routed_W.__getitem__), max(range(W), key=helped_W.__getitem__), 0})
            worst: dict[str, float] = {}
            for rank in ranks:
                counts = layer_counts(slots_WE, rank, RANKS_PER_NODE)
                sides = {
                    "old": {
                        "plan old": lambda: old.plan_replicas(slots_WE, e, REPLICAS, 0),
                        "per-rank old": lambda: _old_per_rank(old, counts, rank, e),
                        "two-level old": lambda: _old_two_level(old, old_splits, counts, rank, e),
                    },
                    "new": {
                        "plan new": lambda: new_plan(slots_WE, e),
                        "per-rank new": lambda: _new_per_rank(counts, rank, e),
                        "two-level new": lambda: _new_two_level(counts, rank, e),
                    },
                }
                for fns in sides.values():  # apart: neither side runs amid the other's memory traffic
                    for name, timing in measure(fns, warmup=1, repeats=repeats).items():
                        worst[name] = max(worst.get(name, 0.0), timing.median_s * 1e3)
            names = ("plan old", "plan new", "per-rank old", "per-rank new", "two-level old", "two-level new")
            rows.append([W, load, len(plan.moves), *(f"{worst[name]:.3f}" for name in names)])
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="7a8d239", help="the git ref whose implementation is the old side")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start_load = load_average()
    rows = run(args.old, args.repeats)
    headers = ["W", "load", "moves", "plan old", "plan new", "per-rank old", "per-rank new"]
    table = markdown_table([*headers, "two-level old", "two-level new"], rows)
    text = (
        f"# Expert replicas: one rank's host bookkeeping per layer call (ms)\n\n"
        f"Reproduce: `python benchmarks/replica_plan.py --old {args.old} --repeats {args.repeats}`\n\n"
        f"- Machine: {machine_description()}; load average {start_load} at the start, {load_average()} at the end.\n"
        f"- E = {EXPERTS} experts, {TOKENS} tokens per rank, top-{TOP_K}, replicas={REPLICAS}, every imbalance worth "
        f"a move; old: the implementation at `{args.old}`, new: this tree's (the same moves, checked).\n"
        f"- `plan`: `plan_replicas` alone; `per-rank` / `two-level`: the plan and everything the layer and that "
        f"transport compute from it on the host for one rank (see the script's docstring); each the slowest of "
        f"three ranks' medians of {args.repeats} rounds, one thread; the old side's calls interleaved among "
        f"themselves, then the new side's.\n\n{table}\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
