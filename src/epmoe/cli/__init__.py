"""The ``epmoe`` command line: ``info``, ``demo``, ``bench``, ``run``."""

from __future__ import annotations

import argparse
import logging
import sys

from epmoe.cli import bench, demo, info, run

_COMMANDS = {"info": info, "demo": demo, "bench": bench, "run": run}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE runtime for PyTorch")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench,run}")
    for module in _COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError) as error:
        print(f"epmoe {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
