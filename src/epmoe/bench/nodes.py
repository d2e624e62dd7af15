"""The two-level exchange against the per-rank one: the bytes that cross between nodes, counted.

    epmoe bench nodes [--quick] [--out benchmarks/nodes_cpu.md]

Nodes emulated on one machine (``ExpertParallelConfig(ranks_per_node=P)``: the same groups and
exchanges a real launch runs, on loopback), 2 nodes x 2 and 2 x 4 gloo ranks, one Qwen3-MoE experts
module (16 experts, top-8; ``--quick``: top-4, fewer tokens) on uniform random routing of
``T`` tokens per rank, float32, one forward + backward. For each arm (``dispatch="alltoallv"``,
each token once per rank holding one of its experts; ``dispatch="nodes"``, once per node, then inside
it), what every rank's exchanges handed other ranks (:func:`epmoe.comm.count_traffic`, by
destination), split by link: *between nodes* and *inside a node*, summed over ranks; the counts
exchange's header bytes beside them (its rows: ``W`` per rank and layer call, ``width`` int64 each,
and the two-level exchange's ``1 + P`` more columns); and the *floor* the routing sets: over every
token, its distinct remote nodes over its remote ranks (the rows crossing between nodes can go no
lower than that share of the per-rank exchange's). Both are counts of this routing, not timings:
``between / per-rank's`` is checked against the floor (goal: within 0.08).

The cost model turns the bytes into time: a step's exchanges take about ``max over ranks of (bytes
it sends between nodes / B_between + bytes it sends inside its node / B_inside)``, each hop in turn;
printed for a NIC of 25 and 50 GB/s between nodes and 400 GB/s inside (NVLink / HCCS class).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

import epmoe
from epmoe.bench import common
from epmoe.comm import count_traffic
from epmoe.launch import run_ranks
from epmoe.models import build_model

LAYOUTS = ((2, 2), (2, 4))  # (nodes, ranks per node)
PER_RANK, TWO_LEVEL = "per-rank", "two-level"
ARMS = {PER_RANK: {"dispatch": "alltoallv"}, TWO_LEVEL: {"dispatch": "nodes"}}
GOAL = 0.08  # |between-nodes ratio - floor| <=
LINKS = ((25e9, 400e9), (50e9, 400e9))  # (between nodes, inside a node) bytes per second
HEADERS = (
    "nodes x ranks",
    "arm",
    "MiB between nodes",
    "MiB inside nodes",
    "header KiB",
    "between / per-rank's",
    "floor",
    *(f"ms at {a / 1e9:g} / {b / 1e9:g} GB/s" for a, b in LINKS),
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    top_k: int
    tokens: int


SHAPE = Shape(hidden=1024, experts=16, top_k=8, tokens=512)
QUICK = Shape(hidden=64, experts=16, top_k=4, tokens=32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # the common options only


def run(args: argparse.Namespace) -> int:
    settings = common.configure(args)
    shape = QUICK if settings.quick else SHAPE
    rows = []
    for nodes, per_node in LAYOUTS:
        result = run_ranks(_rank, nodes * per_node, shape, per_node, settings.seed, threads_per_rank=1, timeout=900)
        rows += _rows(nodes, per_node, result)
    command = f"epmoe bench nodes {settings.options()}"
    text = markdown(shape, rows, settings, command)
    if settings.out:
        Path(settings.out).write_text(text)
    print(text)
    return 0


def _rank(rank: int, world: int, shape: Shape, per_node: int, seed: int) -> dict:
    """This rank's bytes by destination for each arm, its header bytes, and its tokens' floor terms."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    hidden = torch.randn(shape.tokens, shape.hidden, generator=generator)
    index = torch.rand(shape.tokens, shape.experts, generator=generator).argsort(dim=1)[:, : shape.top_k]
    weights = torch.softmax(torch.randn(shape.tokens, shape.top_k, generator=generator), dim=-1)
    base = build_model(
        "qwen3_moe", num_experts=shape.experts, top_k=shape.top_k, hidden_size=shape.hidden, num_hidden_layers=1
    )
    out = {}
    for arm, config in ARMS.items():
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config=dict(config, ranks_per_node=per_node) if arm == TWO_LEVEL else config)
        experts = model.model.layers[0].mlp.experts
        with count_traffic() as traffic:
            x, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
            experts(x, index, w).sum().backward()
        out[arm] = {"by_peer": dict(traffic.bytes_by_peer), "header": world * experts._epmoe.model.channel.width * 8}
    rank_TK = index // (shape.experts // world)
    remote_TK = rank_TK // per_node != rank // per_node
    out["remote_ranks"] = sum(len(set(r[m].tolist())) for r, m in zip(rank_TK, remote_TK))
    out["remote_nodes"] = sum(len(set((r[m] // per_node).tolist())) for r, m in zip(rank_TK, remote_TK))
    return out


def _rows(nodes: int, per_node: int, results: list[dict]) -> list[tuple]:
    """The table's rows of one layout: per arm, the bytes by link summed over ranks, the header bytes,
    the ratio to the per-rank exchange, the floor, and the cost model's times."""
    floor = sum(r["remote_nodes"] for r in results) / max(1, sum(r["remote_ranks"] for r in results))
    figures = {}
    for arm in ARMS:
        between, inside, slowest = 0, 0, {link: 0.0 for link in LINKS}
        for rank, result in enumerate(results):
            mine = {"between": 0, "inside": 0}
            for peer, nbytes in result[arm]["by_peer"].items():
                mine["between" if peer // per_node != rank // per_node else "inside"] += nbytes
            between, inside = between + mine["between"], inside + mine["inside"]
            for link in LINKS:
                slowest[link] = max(slowest[link], mine["between"] / link[0] + mine["inside"] / link[1])
        figures[arm] = (between, inside, sum(r[arm]["header"] for r in results), slowest)
    rows = []
    for arm, (between, inside, header, slowest) in figures.items():
        ratio = between / figures[PER_RANK][0] if figures[PER_RANK][0] else float("nan")
        rows.append(
            (
                f"{nodes} x {per_node}",
                arm,
                f"{between / 2**20:.2f}",
                f"{inside / 2**20:.2f}",
                f"{header / 2**10:.2f}",
                f"{ratio:.3f}",
                f"{floor:.3f}",
                *(f"{1e3 * slowest[link]:.3f}" for link in LINKS),
            )
        )
    return rows


def markdown(shape: Shape, rows: list[tuple], settings: common.Settings, command: str) -> str:
    checks = [
        f"{row[0]}: between-nodes bytes {row[5]} of the per-rank exchange's, floor {row[6]}"
        + (" (within the goal)" if abs(float(row[5]) - float(row[6])) <= GOAL else " (NOT within the goal)")
        for row in rows
        if row[1] == TWO_LEVEL
    ]
    return "\n".join(
        [
            "# Bytes between nodes: the two-level exchange (`epmoe bench nodes`)",
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {common.machine_description(settings.device)}; nodes emulated with ranks_per_node, gloo on "
            "loopback, one thread per rank",
            "",
            f"One Qwen3-MoE experts module, float32, H {shape.hidden}, {shape.experts} experts, top-{shape.top_k}, "
            f"uniform random routing of {shape.tokens} tokens per rank, one forward + backward (the rows out and "
            "back, the gradients back and out).",
            "",
            *[f"- {check}" for check in checks],
            "",
            common.markdown_table(HEADERS, rows),
            "",
            "MiB between / inside nodes: what the ranks' exchanges handed ranks of other nodes / of their own node "
            "(summed over ranks; a rank's own rows stay in memory). Header KiB: the counts exchange's rows of one "
            "layer call (every rank's, int64; the two-level exchange's carry 1 + P more columns). Floor: over every "
            "token, its distinct remote nodes over its remote ranks. ms: the cost model's slowest rank, bytes "
            "between nodes over the first bandwidth plus bytes inside over the second.",
            "",
        ]
    )
