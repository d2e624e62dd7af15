"""Helpers every benchmark shares: common options (and renamed ones), side-by-side timing, FLOP/s, markdown tables.

Timing is side by side: :func:`measure` runs every candidate once per round, in an order rotated
from round to round, so a load change on a shared machine hits all candidates alike; each result is
the median over rounds, with the device synchronised (through :func:`epmoe.platform.synchronize`)
before the clock starts and before it stops.
"""

from __future__ import annotations

import argparse
import os
import platform as host
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe import platform

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RenamedOption(argparse.Action):
    """An option under its current name and an old one kept as an alias that warns (on stderr) when
    used; stores like ``store``, or like ``append`` with ``append=True``."""

    def __init__(self, option_strings, dest, *, old: str, append: bool = False, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old, self.append = old, append

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.old:
            print(
                f"epmoe: warning: {self.old} is renamed {self.option_strings[0]} (the old spelling will go)",
                file=sys.stderr,
            )
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def renamed_option(parser: argparse.ArgumentParser, new: str, old: str, **kwargs) -> None:
    """Add option ``new`` with ``old`` as a warning alias (see :class:`RenamedOption`)."""
    parser.add_argument(new, old, action=RenamedOption, old=old, **kwargs)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every ``epmoe bench`` subcommand accepts (read back by :func:`configure`)."""
    group = parser.add_argument_group("common benchmark options")
    group.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: a smoke run of seconds")
    group.add_argument("--out", metavar="PATH", default=None, help="also write the results as markdown to PATH")
    group.add_argument(
        "--device", default=None, help="device to run on (default: this process's accelerator, else cpu)"
    )
    group.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's current setting)")
    group.add_argument("--warmup", type=int, default=None, help="untimed rounds before measuring (default: 1)")
    group.add_argument(
        "--repeats", type=int, default=None, help="timed rounds; the median is reported (default: 5, 2 with --quick)"
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the random inputs and group counts")


@dataclass(frozen=True)
class Settings:
    """The common options, resolved: what a benchmark runs with and what its report prints."""

    device: torch.device
    threads: int
    warmup: int
    repeats: int
    seed: int
    quick: bool
    out: str | None

    def options(self) -> str:
        """The options that reproduce these settings on the command line."""
        parts = [
            f"--device {self.device}",
            f"--threads {self.threads}",
            f"--warmup {self.warmup}",
            f"--repeats {self.repeats}",
        ]
        if self.seed:
            parts.append(f"--seed {self.seed}")
        if self.quick:
            parts.insert(0, "--quick")
        if self.out:
            parts.append(f"--out {self.out}")
        return " ".join(parts)


def configure(args: argparse.Namespace) -> Settings:
    """Validate the common options, apply the thread count, and return the resolved settings."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: expected a positive count, got {args.threads}")
        torch.set_num_threads(args.threads)
    warmup = 1 if args.warmup is None else args.warmup
    repeats = (2 if args.quick else 5) if args.repeats is None else args.repeats
    if warmup < 0:
        raise ValueError(f"--warmup: expected a count >= 0, got {warmup}")
    if repeats < 1:
        raise ValueError(f"--repeats: expected a count >= 1, got {repeats}")
    kind = platform.device_type(args.device) if args.device else platform.device_type()
    if not platform.is_available(kind):
        raise ValueError(f"--device: {args.device!r} is not available here")
    device = torch.device(args.device) if args.device else platform.current_device(kind)
    return Settings(device, torch.get_num_threads(), warmup, repeats, args.seed, args.quick, args.out)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median over rounds, and every round's sample."""

    median_s: float
    samples_s: tuple[float, ...]

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: how noisy this measurement was."""
        return (max(self.samples_s) - min(self.samples_s)) / self.median_s if self.median_s else 0.0


def measure(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | str | None = None,
    ranks: bool = False,
) -> dict[str, Timing]:
    """Time every function in ``fns`` side by side; the median of ``repeats`` rounds each.

    Each round calls every function once, starting one further along the list than the round
    before, so order effects and load changes during the run are shared out evenly. ``warmup``
    untimed rounds come first. The device is synchronised around every timed call. With ``ranks``
    (every rank of the default group calls it), a barrier precedes each call and each sample is the
    slowest rank's.
    """
    if repeats < 1:
        raise ValueError(f"measure(repeats): expected >= 1, got {repeats}")
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            platform.synchronize(device)
            if ranks:
                dist.barrier()
            start = time.perf_counter()
            fns[name]()
            platform.synchronize(device)
            if round_ >= warmup:
                samples[name].append(time.perf_counter() - start)
    if ranks:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, samples)
        samples = {name: [max(rank[name][i] for rank in every) for i in range(repeats)] for name in names}
    return {name: Timing(statistics.median(s), tuple(s)) for name, s in samples.items()}


def format_flops(rate: float) -> str:
    """A FLOP/s rate with a readable unit: ``'812 MFLOP/s'``, ``'154.2 GFLOP/s'``, ``'1.23 TFLOP/s'``."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if rate >= scale:
            value = rate / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{rate:.3g} FLOP/s"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str | None = None) -> str:
    """A markdown table with padded columns, readable as plain text too.

    ``align`` has one letter per column, ``l`` or ``r`` (default: right for numbers, else left,
    judged from the first row).
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    if any(len(row) != len(headers) for row in cells):
        raise ValueError(f"markdown_table(rows): every row needs {len(headers)} cells")
    if align is None:
        first = rows[0] if rows else headers
        align = "".join("r" if isinstance(c, (int, float)) else "l" for c in first)
    if len(align) != len(headers) or set(align) - {"l", "r"}:
        raise ValueError(f"markdown_table(align): expected {len(headers)} letters of 'l'/'r', got {align!r}")
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = ["-" * (w - 1) + ":" if a == "r" else "-" * w for w, a in zip(widths, align)]
    return "\n".join([line(cells[0]), line(rule), *(line(row) for row in cells[1:])])


def machine_description(device: torch.device | str | None = None) -> str:
    """One line: CPU model and cores (or the accelerator's name), OS, torch version and threads."""
    kind = platform.device_type(device) if device is not None else platform.device_type()
    cpu = _cpu_model()
    parts = [f"{cpu}, {os.cpu_count()} logical CPUs"]
    if kind != "cpu":
        module = platform.device_module(kind)
        name = module.get_device_name() if hasattr(module, "get_device_name") else kind
        parts.insert(0, f"{name} ({kind})")
    parts += [
        f"{host.system()} {host.release()}",
        f"Python {host.python_version()}",
        f"torch {torch.__version__}",
        f"{torch.get_num_threads()} torch threads",
    ]
    return "; ".join(parts)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or ``None`` where the OS does not say.

    Recorded at the start and end of a run: at the end the run's own threads count in it, so a
    load above the thread count means the timings shared the CPUs with other work.
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or host.machine()
