"""``epmoe bench <name>``: one subcommand per benchmark module of :mod:`epmoe.bench`.

A benchmark is a module ``epmoe.bench.<name>`` exposing ``add_arguments(parser)`` and
``run(args) -> int``, its first docstring line being the subcommand's help. Each module in
``BENCHMARKS`` becomes a subcommand, with the options all benchmarks share
(:func:`epmoe.bench.common.add_common_arguments`: ``--quick``, ``--out``, ``--device``,
``--threads``, ``--warmup``, ``--repeats``, ``--seed``).
"""

from __future__ import annotations

import argparse

from epmoe.bench import balance, checkpoint, common, experts, fused, gmm, layer, nodes, versus

BENCHMARKS = {
    "gmm": gmm,
    "layer": layer,
    "fused": fused,
    "checkpoint": checkpoint,
    "versus": versus,
    "experts": experts,
    "balance": balance,
    "nodes": nodes,
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    modules = BENCHMARKS
    parser = commands.add_parser(
        "bench", help="benchmarks: tables of time and FLOP/s", description=__doc__.splitlines()[0].replace("``", "'")
    )
    subcommands = parser.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(modules) + "}")
    for name, module in modules.items():
        summary = (module.__doc__ or name).strip().splitlines()[0].replace("``", "'")
        sub = subcommands.add_parser(name, help=summary, description=summary)
        module.add_arguments(sub)
        common.add_common_arguments(sub)
        sub.set_defaults(bench_run=module.run)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)
