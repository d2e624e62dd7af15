"""``epmoe run [--ep N] [--config JSON] -- COMMAND ...``: run the user's own command (a framework's CLI,
``torchrun``, ``accelerate launch``) with every MoE model it loads made expert-parallel and every
``transformers.Trainer`` it builds prepared (:mod:`epmoe.compose.run`, docs/frameworks.md).

The settings travel in ``EPMOE_RUN``; the directory holding only the bootstrap ``sitecustomize.py``
goes first on ``PYTHONPATH``; then this process becomes the command (``os.execvpe``: its signals and
exit code are the command's own)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
ENV = "EPMOE_RUN"  # read by epmoe.compose.run in the command's processes


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="run a command (torchrun, accelerate launch, a framework's CLI) with its MoE models expert-parallel",
        usage="epmoe run [--ep N] [--config JSON] -- COMMAND ...",
    )
    parser.add_argument("--ep", type=_ep_size, default=None, help="the EP size (default: the world size)")
    parser.add_argument(
        "--config",
        type=_config,
        default={},
        help="a JSON object of ExpertParallelConfig fields, e.g. '{\"timeout\": 60}'",
    )
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command to run, after --")
    parser.set_defaults(run=run)


def _ep_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _config(text: str) -> dict:
    """The JSON object, checked by building the config it names (an unknown field or a bad value is
    refused here, before anything runs)."""
    from epmoe.ep import ExpertParallelConfig

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of ExpertParallelConfig fields, got {text!r}")
    try:
        ExpertParallelConfig.from_any(fields)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return fields


def environment(ep: int | None, config: dict, base: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: ``base`` (this process's) with ``EPMOE_RUN`` and the bootstrap first
    on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env[ENV] = json.dumps({"ep": ep, "config": config})
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ValueError("no command: epmoe run [--ep N] [--config JSON] -- COMMAND ...")
    program = shutil.which(command[0])
    if program is None:
        raise ValueError(f"command not found: {command[0]!r}")
    os.execvpe(program, command, environment(args.ep, args.config))
