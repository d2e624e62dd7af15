"""``epmoe bench``."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="not yet available")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise ValueError("'bench' is not implemented yet")
