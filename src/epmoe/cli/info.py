"""``epmoe info``: torch, devices, communication backend, and every grouped-matmul backend."""

from __future__ import annotations

import argparse

import torch

import epmoe
from epmoe import platform


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("info", help="show torch, devices and grouped-matmul backends")
    parser.add_argument("--device", default=None, help="device to check the backends on (default: this process's)")
    parser.set_defaults(run=run)


def report(device: str | None = None) -> str:
    kind = platform.device_type(device) if device else platform.device_type()
    if device is not None and not platform.is_available(kind):
        raise ValueError(f"--device: {device!r} is not available here")
    target = platform.current_device(kind)
    lines = [
        f"epmoe {epmoe.__version__}",
        f"torch {torch.__version__}",
        f"device: {target} (available: {', '.join(t for t in ('cpu', 'cuda', 'npu', 'xpu', 'mps') if platform.is_available(t))})",
        f"communication backend: {platform.comm_backend(kind)}",
        "grouped-matmul backends (bf16, 256 x 1024 rows, 8 experts of nn.Linear-layout 1024 x 1024 weights):",
    ]
    x = torch.zeros(256, 1024, dtype=torch.bfloat16, device=target)
    weight = torch.zeros(8, 1024, 1024, dtype=torch.bfloat16, device=target)
    for status in epmoe.gmm_backends(x, weight, trans_weight=True):
        verdict = "eligible" if status.eligible else f"declines: {status.reason}"
        lines.append(f"  {status.name:<8} {verdict}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(report(args.device))
    return 0
