"""``epmoe demo``: train a small MoE model with and without expert parallelism, and compare.

Spawns ``--nproc`` gloo ranks on this machine (or joins the ranks of ``torchrun``), trains the same
model both ways (see :mod:`epmoe.demo`; ``--trainer``: through ``transformers.Trainer``), prints a
per-step table and writes a loss-curve plot.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import tempfile
from pathlib import Path

import torch.distributed as dist

from epmoe import platform
from epmoe.bench.common import renamed_option
from epmoe.demo import TrainOptions, TrainResult, train_parity
from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.load import max_over_mean
from epmoe.launch import run_ranks


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="EP training vs the same without EP: parity table and plot")
    parser.add_argument("--model", default="qwen3_moe", help="model family (default: qwen3_moe)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun; default 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float64 (default float32)")
    renamed_option(
        parser,
        "--gmm-backend",
        "--backend",
        dest="gmm_backend",
        default="auto",
        help="grouped-matmul backend (default auto)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | npu (default cpu)")
    parser.add_argument(
        "--trainer", action="store_true", help="train both models through transformers.Trainer instead of a DDP loop"
    )
    parser.add_argument(
        "--balance", action="store_true", help="auxiliary-loss-free load balancing (epmoe.LoadBalancer) on both models"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="experts of other ranks a rank may compute rows of per layer call (ExpertParallelConfig(replicas=N); default 0)",
    )
    parser.add_argument("--out", default="epmoe-out", help="directory for the plot (default ./epmoe-out)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the run is abandoned")
    parser.set_defaults(run=run)


def format_table(result: TrainResult) -> str:
    lines = [
        f"{'step':>4}  {'loss (EP)':>10}  {'loss (no EP)':>12}  {'|diff|':>9}  {'time EP':>9}  {'time no EP':>10}"
        f"  {'rows/rank':>9}  max/mean expert load per layer",
    ]
    for r in result.records:
        lines.append(
            f"{r.step:>4}  {r.loss_ep:>10.6f}  {r.loss_ref:>12.6f}  {r.diff:>9.2e}  "
            f"{r.time_ep * 1e3:>7.1f}ms  {r.time_ref * 1e3:>8.1f}ms  {r.rank_imbalance:>9.2f}  "
            + " ".join(f"{x:.2f}" for x in r.imbalance)
        )
    return "\n".join(lines)


LOAD_WINDOW = 5  # steps whose loads are summed: the persistent skew the balancer removes, not one batch's noise


def window_imbalance(result: TrainResult) -> list[tuple[int, int, float]]:
    """``(first step, end, max/mean)`` of the EP model's expert load summed over consecutive windows of
    ``LOAD_WINDOW`` steps, averaged over the layers."""
    out = []
    for start in range(0, len(result.records), LOAD_WINDOW):
        part = result.records[start : start + LOAD_WINDOW]
        values = [
            max_over_mean([sum(column) for column in zip(*(r.load[name] for r in part))]) for name in part[0].load
        ]
        out.append((part[0].step, part[-1].step + 1, statistics.fmean(values)))
    return out


def plot_load(result: TrainResult, path: Path) -> Path:
    """A heat map per MoE layer: each expert's share of the layer's routed slots (rows) at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.records[0].load)
    shares = [[[c / max(1, sum(r.load[name])) for c in r.load[name]] for r in result.records] for name in names]
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names) + 1, 4.5), squeeze=False)
    top = max(max(max(step) for step in layer) for layer in shares)
    for ax, name, layer in zip(axes[0], names, shares):
        image = ax.imshow(
            [list(col) for col in zip(*layer)],
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=0,
            vmax=top,
            interpolation="nearest",
        )
        ax.set_title(name.replace(".mlp.experts", ""), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    balanced = " (LoadBalancer on)" if result.options.balance else ""
    fig.suptitle(f"{result.options.family}: share of each layer's routed slots per expert{balanced}")
    fig.colorbar(image, ax=axes[0].tolist(), label="share of the layer's slots")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(result: TrainResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in result.records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.loss_ref for r in result.records], label="without EP", linewidth=3, alpha=0.5)
    ax.plot(steps, [r.loss_ep for r in result.records], label=f"with EP ({result.world_size} ranks)", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{result.options.family}, {result.options.dtype}: loss with and without expert parallelism")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _validate(args: argparse.Namespace) -> TrainOptions:
    """Every option checked before any rank starts (a ValueError: one line, exit status 2)."""
    if args.nproc < 1:
        raise ValueError(f"--nproc: must be >= 1, got {args.nproc}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.device != "cpu" and not platform.is_available(args.device):
        raise ValueError(f"--device: {args.device!r} is not available on this machine")
    options = TrainOptions(
        family=args.model,
        steps=args.steps,
        dtype=args.dtype,
        backend=args.gmm_backend,
        device=args.device,
        trainer=args.trainer,
        balance=args.balance,
        replicas=args.replicas,
        show_progress=not args.trainer,
    )
    # a bad --gmm-backend or --replicas fails here, not in every rank
    ExpertParallelConfig(gmm_backend=args.gmm_backend, replicas=args.replicas)
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.nproc
    if options.num_experts % world:
        what = "the torchrun world size" if _under_torchrun() else "--nproc"
        raise ValueError(
            f"{what}: {world} ranks cannot share the demo model's {options.num_experts} experts "
            f"evenly; use a divisor of {options.num_experts} (1, 2, 4, 8...)"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create {out}: {exc.strerror}") from None
    try:  # where the plots go must be writable before anything trains (a read-only mount, no permission)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out: cannot write in {out}: {exc.strerror}") from None
    return options


def run(args: argparse.Namespace) -> int:
    options = _validate(args)
    if _under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(platform.comm_backend(args.device), timeout=datetime.timedelta(seconds=args.timeout))
        try:
            result = train_parity(rank, world, options)
        finally:
            gc.collect()  # DDP reducers in reference cycles must go before their process group does
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        backend = platform.comm_backend(args.device)
        result = run_ranks(train_parity, args.nproc, options, backend=backend, timeout=args.timeout)[0]
    print()
    print(format_table(result))
    worst = max(r.diff for r in result.records)
    loop = (
        "transformers.Trainer (epmoe.prepare_trainer on the EP side)"
        if args.trainer
        else "DistributedDataParallel + gradient clipping"
    )
    timed = result.records[1:] or result.records  # step 0 includes warm-up
    ratio = statistics.median(r.time_ep for r in timed) / statistics.median(r.time_ref for r in timed)
    print(
        f"\nmodel {args.model} ({result.options.num_experts} experts, top-{result.options.top_k}), "
        f"{result.world_size} ranks, {args.dtype}, {loop}; with EP: epmoe, grouped-matmul backend: "
        f"{result.gmm_backend}; without EP: transformers' eager experts"
        f"\nmax |loss difference| {worst:.2e}; median step time with EP / without EP: {ratio:.2f}"
    )
    print(
        f"checkpoint: save_pretrained at EP={result.world_size}, reloaded by plain transformers at EP=1: "
        f"max relative logits difference {result.reload_error:.2e}"
    )
    windows = ", ".join(f"steps {start}-{end - 1} {value:.2f}" for start, end, value in window_imbalance(result))
    print(
        f"expert load max/mean of {LOAD_WINDOW}-step windows (mean over layers): {windows}"
        f"{' (LoadBalancer on)' if args.balance else ' (--balance: with epmoe.LoadBalancer)'}"
    )
    rows = statistics.fmean(r.rank_imbalance for r in result.records)
    print(
        f"rows computed per rank, max/mean (the most skewed layer, mean over steps): {rows:.2f}"
        + (
            f" (replicas={args.replicas}: hot experts computed on other ranks too, where the cost model says it pays)"
            if args.replicas
            else " (--replicas N: hot experts computed on other ranks too, exactly)"
        )
    )
    path = plot(result, Path(args.out) / f"demo-{args.model}-loss.png")
    print(f"loss curves plotted to {path.resolve()}")
    heat = plot_load(result, Path(args.out) / f"demo-{args.model}-load.png")
    print(f"expert load heat map written to {heat.resolve()}")
    return 0
