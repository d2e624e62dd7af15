"""``epmoe bench fused``: fused alltoallv_gmm / gmm_alltoallv against exchange-then-compute, on W ranks.

One MoE expert block per rank, with the routed experts of a Qwen3-30B-A3B-like layer (``nn.Linear``
weight layout, ``trans_weight=True``) and optionally a shared expert::

    dispatch   x_rank_major (T*k, H) --alltoallv_gmm(gate_up (e, 2I, H))--> (rows, 2I)   [+ shared gate_up]
    act        silu(gate) * up                                             (rows, I)
    combine    (rows, I) --gmm_alltoallv(down (e, H, I))--> z_rank_major (T*k, H)          [+ shared down]

Variants, timed side by side in one run (every variant once per round, rotated; a barrier before
each call; a round's time is the slowest rank's)::

    compute only      the same grouped matmuls (and shared matmuls) on local data: no communication
    comm only         the two exchanges alone (all-to-all-v of H-wide rows there and back)
    unfused           impl="reference": exchange, then permute and grouped matmul (and back)
    fused c=N         impl=--impl (default auto: pipelined off NPU) with num_chunks=N

``exposed comm = time - compute only`` (what communication and its packing copies add) and
``overlap = 1 - exposed comm / comm only`` (the share of the communication time that is hidden;
negative when the copies and per-round costs outweigh what is hidden). ``fwd+bwd`` adds the
backward pass (two more exchanges). The NCCL run is the same command with ``--dist-backend nccl`` on a
machine with W GPUs; HCCL with ``--dist-backend hccl``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from epmoe import platform
from epmoe.bench import common
from epmoe.comm import all_to_all_v, alltoallv_gmm, exchange_counts, gmm_alltoallv
from epmoe.comm.fused import IMPLS
from epmoe.comm.layout import RowLayout
from epmoe.gmm import grouped_mm, select_backend
from epmoe.launch import run_ranks

HEADERS = ("shared", "pass", "variant", "time ms", "exposed comm ms", "overlap", "vs unfused", "spread")
PASSES = ("fwd", "fwd+bwd")
IMBALANCE = 0.3  # sigma of the log-normal expert popularity tokens pick their experts by
DEFAULT_CHUNKS = (1, 2, 4)


@dataclass(frozen=True)
class Shape:
    """One rank's share of a MoE layer under expert parallelism."""

    name: str
    model: str
    experts: int  # global experts E = W * e
    hidden: int  # H
    intermediate: int  # I per routed expert
    shared_intermediate: int  # of the shared expert
    tokens: int  # T per rank
    top_k: int


SHAPES = {
    "qwen3-30b-a3b-cpu": Shape(
        "qwen3-30b-a3b-cpu",
        "Qwen3-30B-A3B scaled to a 2-core CPU: H 2048->1024, I 768->384, 128->32 experts, top-8->4, "
        "512 tokens per rank; shared expert (Qwen3 has none) of intermediate 2I",
        experts=32,
        hidden=1024,
        intermediate=384,
        shared_intermediate=768,
        tokens=512,
        top_k=4,
    ),
    "qwen3-30b-a3b-cpu-comm-bound": Shape(
        "qwen3-30b-a3b-cpu-comm-bound",
        "qwen3-30b-a3b-cpu with I and the shared intermediate divided by 8 (48, 96): compute about as long "
        "as communication, where overlap matters most",
        experts=32,
        hidden=1024,
        intermediate=48,
        shared_intermediate=96,
        tokens=512,
        top_k=4,
    ),
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B as is: H 2048, I 768, 128 experts, top-8, 4096 tokens per rank; shared expert of "
        "intermediate 2I",
        experts=128,
        hidden=2048,
        intermediate=768,
        shared_intermediate=1536,
        tokens=4096,
        top_k=8,
    ),
    "tiny": Shape(
        "tiny", "smoke test", experts=8, hidden=64, intermediate=32, shared_intermediate=64, tokens=32, top_k=2
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn (default: 2)")
    common.renamed_option(
        parser,
        "--dist-backend",
        "--backend",
        dest="dist_backend",
        default=None,
        help="torch.distributed backend (default: the device's, gloo on CPU, nccl on CUDA)",
    )
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        action="append",
        default=None,
        help="per-rank shape (repeatable; default: qwen3-30b-a3b-cpu and its comm-bound variant on "
        "CPU, qwen3-30b-a3b elsewhere; tiny with --quick)",
    )
    parser.add_argument(
        "--dtype", choices=list(common.DTYPES), default=None, help="default: fp32 on CPU, bf16 elsewhere"
    )
    parser.add_argument(
        "--chunks",
        type=int,
        action="append",
        default=None,
        help="num_chunks of the fused variants (repeatable; default: 1 2 4)",
    )
    parser.add_argument(
        "--impl",
        choices=[i for i in IMPLS if i != "reference"],
        default="auto",
        help="implementation of the fused variants (default: auto)",
    )


def run(args: argparse.Namespace) -> int:
    settings = common.configure(args)
    if args.world < 1:
        raise ValueError(f"--world: expected a positive count, got {args.world}")
    kind = settings.device.type
    backend = args.dist_backend or platform.comm_backend(kind)
    shapes = [SHAPES[name] for name in args.shape or _default_shapes(args.quick, kind)]
    for shape in shapes:
        if shape.experts % args.world:
            raise ValueError(
                f"--world: {shape.experts} experts of shape {shape.name!r} do not split over {args.world} ranks"
            )
    dtype = args.dtype or ("fp32" if kind == "cpu" else "bf16")
    chunks = sorted(set(args.chunks or DEFAULT_CHUNKS))
    if min(chunks) < 1:
        raise ValueError(f"--chunks: expected counts >= 1, got {chunks}")
    config = dict(
        shapes=[asdict(s) for s in shapes],
        dtype=dtype,
        chunks=chunks,
        impl=args.impl,
        kind=kind,
        warmup=settings.warmup,
        repeats=settings.repeats,
        seed=settings.seed,
    )
    load_start = common.load_average()
    rows, info = run_ranks(
        _rank_main, args.world, config, backend=backend, timeout=3600, threads_per_rank=args.threads
    )[0]
    load = (load_start, common.load_average())
    sections = []
    for shape in shapes:
        shape_rows = [r for r in rows if r["shape"] == shape.name]
        table = common.markdown_table(HEADERS, [_cells(r) for r in shape_rows], align="lllrrrrr")
        summary = summarize(shape_rows)
        print(f"{shape.name}\n\n{table}\n\n" + "\n".join(summary) + "\n")
        sections.append((shape, table, summary, info[shape.name]))
    if settings.out:
        with open(settings.out, "w") as out:
            out.write(_document(sections, settings, args, backend, dtype, chunks, load))
        print(f"wrote {settings.out}")
    return 0


def _default_shapes(quick: bool, kind: str) -> list[str]:
    if quick:
        return ["tiny"]
    return ["qwen3-30b-a3b-cpu", "qwen3-30b-a3b-cpu-comm-bound"] if kind == "cpu" else ["qwen3-30b-a3b"]


# --------------------------------------------------------------------------------------------
# on every rank
# --------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, config: dict):
    kind = config["kind"]
    if kind != "cpu":
        platform.device_module(kind).set_device(rank % platform.device_module(kind).device_count())
    device = platform.current_device(kind)
    dtype = common.DTYPES[config["dtype"]]
    rows, info = [], {}
    for fields in config["shapes"]:
        shape = Shape(**fields)
        for shared in (False, True):
            block = _Block(shape, rank, world, device, dtype, shared, config["seed"])
            for pass_ in PASSES:
                fns = block.variants(pass_, config["chunks"], config["impl"])
                timings = common.measure(
                    fns, warmup=config["warmup"], repeats=config["repeats"], device=device, ranks=True
                )
                rows += _rows(shape.name, shared, pass_, timings)
        info[shape.name] = dict(
            rows_per_rank=block.rows_sent,
            received=block.rows_received,
            local_experts=block.e,
            group_sizes=(min(block.group_sizes), max(block.group_sizes)),
            gmm_backend=block.gmm_backend,
            machine=common.machine_description(device),
        )
    return rows, info


class _Block:
    """One rank's inputs and the timed closures of every variant."""

    def __init__(self, shape: Shape, rank: int, world: int, device, dtype, shared: bool, seed: int):
        self.e = shape.experts // world
        H, I, Is = shape.hidden, shape.intermediate, shape.shared_intermediate
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        popularity = torch.exp(IMBALANCE * torch.randn(shape.experts, generator=torch.Generator().manual_seed(seed)))
        picks = torch.multinomial(popularity.expand(shape.tokens, -1), shape.top_k, generator=g)
        histogram = torch.bincount(picks.flatten(), minlength=shape.experts)
        self.send, self.recv = exchange_counts(histogram.to(device))
        self.rows_sent, self.rows_received = sum(self.send), sum(self.recv)
        layout = RowLayout.one_round(world, self.e, self.send, self.recv)
        self.group_sizes = layout.rows_per_expert_e
        self.send_splits, self.recv_splits = layout.rank_major_splits, layout.expert_major_splits_W

        def randn(*size, scale=1.0):
            return (torch.randn(*size, generator=g) * scale).to(device, dtype)

        self.x = randn(self.rows_sent, H)
        self.x_expert_major = randn(self.rows_received, H)  # what compute-only multiplies
        self.gate_up = randn(self.e, 2 * I, H, scale=H**-0.5)
        self.down = randn(self.e, H, I, scale=I**-0.5)
        self.dz = randn(self.rows_sent, H)
        self.dz_expert_major = randn(self.rows_received, H)
        self.shared = shared
        if shared:
            self.shared_x = randn(shape.tokens, H)
            self.shared_gate_up = randn(2 * Is, H, scale=H**-0.5)
            self.shared_down = randn(H, Is, scale=Is**-0.5)
            self.dshared = randn(shape.tokens, H)
        self.gmm_backend = select_backend(self.x_expert_major, self.gate_up, trans_weight=True).name

    def variants(self, pass_: str, chunks: list[int], impl: str) -> dict:
        fns = {
            "compute only": self._compute_only,
            "comm only": self._comm_only,
            "unfused": lambda leaves: self._layer(leaves, "reference", 1),
        }
        for c in chunks:
            fns[f"fused c={c}"] = lambda leaves, c=c: self._layer(leaves, impl, c)
        return {name: self._pass(fn, pass_) for name, fn in fns.items()}

    def _pass(self, fn, pass_: str):
        names = ["x", "x_expert_major", "gate_up", "down"]
        if self.shared:
            names += ["shared_x", "shared_gate_up", "shared_down"]
        if pass_ == "fwd":
            leaves = {n: getattr(self, n) for n in names}

            def forward():
                with torch.no_grad():
                    fn(leaves)

            return forward
        leaves = {n: getattr(self, n).detach().requires_grad_() for n in names}

        def forward_backward():
            outputs, grads = fn(leaves)
            torch.autograd.backward(outputs, grads)

        return forward_backward

    @staticmethod
    def _act(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _layer(self, t: dict, impl: str, chunks: int):
        shared = {}
        if self.shared:
            shared = dict(shared_x=t["shared_x"], shared_weight=t["shared_gate_up"], trans_shared_weight=True)
        y, shared_y, _ = alltoallv_gmm(
            t["x"],
            t["gate_up"],
            self.send,
            self.recv,
            trans_weight=True,
            num_chunks=chunks,
            impl=impl,
            check=False,
            **shared,
        )  # counts exchanged
        if self.shared:
            shared = dict(shared_x=self._act(shared_y), shared_weight=t["shared_down"], trans_shared_weight=True)
        z, shared_z = gmm_alltoallv(
            self._act(y),
            t["down"],
            self.recv,
            self.send,
            trans_weight=True,
            num_chunks=chunks,
            impl=impl,
            check=False,
            **shared,
        )
        return self._outputs(z, shared_z)

    def _compute_only(self, t: dict):
        y = grouped_mm(t["x_expert_major"], t["gate_up"], self.group_sizes, trans_weight=True)
        z = grouped_mm(self._act(y), t["down"], self.group_sizes, trans_weight=True)
        shared_z = None
        if self.shared:
            shared_z = self._act(t["shared_x"] @ t["shared_gate_up"].t()) @ t["shared_down"].t()
        return self._outputs(z, shared_z, dz=self.dz_expert_major)

    def _comm_only(self, t: dict):
        there = all_to_all_v(t["x"], self.recv_splits, self.send_splits)
        back = all_to_all_v(there, self.send_splits, self.recv_splits)
        return self._outputs(back, None)

    def _outputs(self, z, shared_z, dz=None):
        dz = self.dz if dz is None else dz
        if shared_z is None:
            return [z], [dz]
        return [z, shared_z], [dz, self.dshared]


def _rows(shape: str, shared: bool, pass_: str, timings: dict[str, common.Timing]) -> list[dict]:
    compute = timings["compute only"].median_s
    comm = timings["comm only"].median_s
    unfused = timings["unfused"].median_s
    rows = []
    for name, timing in timings.items():
        t = timing.median_s
        exposed = overlap = None
        if name not in ("compute only", "comm only"):
            exposed = t - compute
            overlap = 1 - exposed / comm if comm > 0 else None
        rows.append(
            dict(
                shape=shape,
                shared=shared,
                pass_=pass_,
                variant=name,
                seconds=t,
                exposed=exposed,
                overlap=overlap,
                vs_unfused=t / unfused,
                spread=timing.spread,
            )
        )
    return rows


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _cells(row: dict) -> tuple:
    exposed = "" if row["exposed"] is None else f"{row['exposed'] * 1e3:.1f}"
    overlap = "" if row["overlap"] is None else f"{row['overlap']:.0%}"
    return (
        "yes" if row["shared"] else "no",
        row["pass_"],
        row["variant"],
        f"{row['seconds'] * 1e3:.1f}",
        exposed,
        overlap,
        f"{row['vs_unfused']:.2f}",
        f"{row['spread']:.0%}",
    )


def summarize(rows: list[dict]) -> list[str]:
    """Markdown bullets: per setting the best fused variant against unfused; rounds against c=1; noise."""
    lines, round_gains = [], []
    settings = sorted({(r["shared"], r["pass_"]) for r in rows}, key=lambda k: (k[0], PASSES.index(k[1])))
    for shared, pass_ in settings:
        group = {r["variant"]: r for r in rows if r["shared"] == shared and r["pass_"] == pass_}
        fused = [r for name, r in group.items() if name.startswith("fused")]
        best = min(fused, key=lambda r: r["seconds"])
        one = group.get("fused c=1")
        label = f"shared expert {'on' if shared else 'off'}, {pass_}"
        lines.append(
            f"- {label}: comm only {_ms(group['comm only'])}, compute only {_ms(group['compute only'])}, "
            f"unfused {_ms(group['unfused'])}; best fused `{best['variant']}` {_ms(best)} "
            f"({best['vs_unfused']:.2f}x unfused, overlap {best['overlap']:.0%})"
            + (f", `fused c=1` {one['vs_unfused']:.2f}x unfused." if one is not None and one is not best else ".")
        )
        rounds = [r for r in fused if r is not one]
        if one is not None and rounds:
            fastest = min(rounds, key=lambda r: r["seconds"])
            round_gains.append((one["seconds"] / fastest["seconds"], f"{label}, `{fastest['variant']}`"))
    spreads = sorted(r["spread"] for r in rows)
    noise = statistics.median(spreads)
    if round_gains:
        best_gain, where = max(round_gains)
        verdict = (
            f"within the noise ({noise:.0%}): no measured gain from rounds here"
            if best_gain < 1 + noise
            else "a gain beyond the noise"
        )
        lines.append(
            f"- Rounds (num_chunks > 1) against `fused c=1`: at best {best_gain:.2f}x as fast ({where}); {verdict}."
        )
    lines.append(
        f"- Noise, (slowest - fastest round) / median: {noise:.0%} for the median row, {spreads[-1]:.0%} at worst."
    )
    return lines


def _ms(row: dict) -> str:
    return f"{row['seconds'] * 1e3:.1f} ms"


def _document(sections, settings, args, backend, dtype, chunks, load) -> str:
    extra = f" --world {args.world} --dist-backend {backend} --dtype {dtype} --impl {args.impl}"
    extra += "".join(f" --shape {shape.name}" for shape, *_ in sections) + "".join(f" --chunks {c}" for c in chunks)
    command = f"epmoe bench fused {settings.options()}{extra}"
    machine = sections[0][3]["machine"]
    parts = []
    for shape, table, summary, info in sections:
        low, high = info["group_sizes"]
        parts.append(f"""## `{shape.name}`

{shape.model}. Per rank: {info["rows_per_rank"]} routed rows sent, {info["received"]} received over
{info["local_experts"]} local experts ({low} to {high} rows each), {dtype}, grouped-matmul backend
`{info["gmm_backend"]}`.

{table}

{chr(10).join(summary)}
""")
    return f"""# Fused dispatch / combine benchmark: `epmoe bench fused`

Reproduce (from the repository root, after `pip install -e .`):

    {command}

- Machine: {machine}; {args.world} ranks on `{backend}`, {settings.threads} torch thread(s) per rank.
- Run: {datetime.date.today().isoformat()}; every variant of a (shape, shared, pass) setting timed side by
  side, interleaved round by round with a barrier before each call; a round's time is the slowest
  rank's; median of {settings.repeats} rounds after {settings.warmup} warm-up round(s).
- 1-minute load average at the start / end: {_load(load[0])} / {_load(load[1])}.

Variants: `compute only` = the two grouped matmuls (and the shared expert) on local data;
`comm only` = the two all-to-all-v exchanges alone; `unfused` = `impl="reference"` (exchange, then
permute and grouped matmul; grouped matmul, then exchange back); `fused c=N` = `impl="{args.impl}"`
with `num_chunks=N`. `exposed comm` = time - compute only; `overlap` = 1 - exposed comm / comm only
(negative: the packing copies and per-round costs exceed what is hidden); `vs unfused` = time / unfused
time; `spread` = (slowest - fastest round) / median.

Other backends, same benchmark, one command on a machine with two GPUs (bf16, shape
`qwen3-30b-a3b` unscaled; `--dist-backend hccl --device npu` on Ascend):

    epmoe bench fused --device cuda --dist-backend nccl --world 2 --out benchmarks/fused_nccl.md

{chr(10).join(parts)}"""


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"
