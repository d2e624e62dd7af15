"""What routing replay costs: a training step with and without :func:`epmoe.replay_routing`, side by side.

    python benchmarks/replay.py [--ranks 2] [--repeats 15] [--out benchmarks/replay_cpu.md]

The small Qwen3-MoE (fp32), made expert-parallel over ``--ranks`` gloo ranks (1: no EP), one forward +
backward of ``4 x 64`` tokens per rank: plain, and inside ``replay_routing`` with the routes recorded
from the same batch (per position; entering the block included, which validates the routes: one host
read), timed side by side (``epmoe.bench.common.measure``: rounds interleaved, median, the slowest
rank's). Host reads of each step are counted too (``Tensor.item / tolist / cpu ...`` calls).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

import epmoe
from epmoe.bench.common import load_average, machine_description, markdown_table, measure
from epmoe.launch import run_ranks
from epmoe.models import build_model

READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def _counting_reads(calls: list):
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _steps(rank: int, world: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("qwen3_moe")
    if world > 1:
        epmoe.apply_expert_parallel(model)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(rank))
    with epmoe.record_routing(model) as rec:
        model(ids)
    routes = rec.routes_by_position()

    def plain():
        model(ids, labels=ids).loss.backward()

    def replayed():
        with epmoe.replay_routing(model, routes):
            model(ids, labels=ids).loss.backward()

    def replayed_record():
        with epmoe.replay_routing(model, rec):
            model(ids, labels=ids).loss.backward()

    steps = {"plain": plain, "replayed (routes tensor)": replayed, "replayed (record)": replayed_record}
    timings = measure(steps, warmup=2, repeats=repeats, ranks=world > 1)
    reads = {}
    for name, step in steps.items():
        with _counting_reads([]) as calls:
            step()
        reads[name] = len(calls)
    return {name: timing.median_s for name, timing in timings.items()} | {"reads": reads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = (
        _steps(0, 1, args.repeats)
        if args.ranks == 1
        else max(run_ranks(_steps, args.ranks, args.repeats, timeout=900), key=lambda r: r["plain"])
    )
    rows = [
        [name, f"{result[name] * 1e3:.2f}", f"{result[name] / result['plain']:.3f}", result["reads"][name]]
        for name in result["reads"]
    ]
    table = markdown_table(["step", "ms (median)", "vs plain", "host reads per step"], rows)
    text = (
        f"# Routing replay overhead\n\nReproduce: `python benchmarks/replay.py --ranks {args.ranks} "
        f"--repeats {args.repeats}`\n\n- Machine: {machine_description()}; load average {load_average()}.\n"
        f"- Qwen3-MoE (epmoe.models, fp32), EP {args.ranks}, forward + backward of 4 x 64 tokens per rank, "
        f"one thread per rank; the slowest rank's median of {args.repeats} interleaved rounds.\n"
        f"- `replayed (routes tensor)`: the step inside `replay_routing` with per-position routes, entering "
        f"the block (the routes validated: one host read, and one agreement step on the EP group) and "
        f"leaving it (one agreement step) included; `replayed (record)`: with the record itself (nothing "
        f"to validate: the agreement on leaving only). Host reads: every `Tensor.item / tolist / cpu ...` "
        f"call of the step (an agreement step reads what it received).\n\n{table}\n"
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
