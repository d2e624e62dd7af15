"""``epmoe demo``."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="not yet available")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise ValueError("'demo' is not implemented yet")
