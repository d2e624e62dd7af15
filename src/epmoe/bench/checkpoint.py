"""``epmoe bench checkpoint``: peak memory per rank of building or loading an EP model, and of saving it.

An expert-dominated Qwen3-MoE (64 experts by default) is saved once with a plain ``save_pretrained``
(the Hub's per-expert layout). Then, for EP sizes 2 and 4, each variant runs in a fresh set of gloo
ranks (peak memory is per process), side by side in one run::

    build then EP          epmoe.models.build_model (random init) -> apply_expert_parallel
    from_pretrained + EP   transformers from_pretrained (every expert) -> apply_expert_parallel
    epmoe.from_pretrained  every rank reads only its experts (shard-on-read)
    ... packed layout      the same from a checkpoint saved in transformers' packed layout
                           (save_original_format=False): no per-expert conversion while loading
    ... bf16 checkpoint    the same from the Hub layout saved in bfloat16 (loaded as float32: cast)
    save_pretrained        epmoe.from_pretrained, then save_pretrained on every rank (rank 0 writes)

Per rank: the peak of ``RssAnon`` (private anonymous memory, the number that must fit; clean
file-backed pages of the memory-mapped checkpoint are not in it), sampled every 2 ms by a thread,
and the peak resident set (``VmHWM``, file pages included, reset through ``/proc/self/clear_refs``
at the baseline), each above its value at the baseline. The baseline is taken after imports, and
for ``save_pretrained`` after loading (what it holds beyond the loaded model). The reference is
what the rank must hold anyway: for loading, non-expert weights + its own experts' weights (goal:
``epmoe.from_pretrained`` within 1.25x of it in private memory, within 2.5x in resident set); for
saving, one experts module's gathered weights (all ``E`` experts of one layer; goal: within 1x of
it beyond the loaded model). Linux only (``/proc/self/status``).

Every variant runs twice, side by side, under two settings of glibc's allocator (``--quick``: the
first only): ``default`` (the ranks' environment without ``MALLOC_*`` or ``GLIBC_TUNABLES``
variables: what a user gets) and ``tuned`` (``MALLOC_MMAP_THRESHOLD_=1048576``). With the default,
the threshold above which a buffer is mapped on its own rises to the largest buffer freed (up to 32
MiB), so freed buffers of this model's sizes (1-32 MiB) stay in the heap and count in ``RssAnon``
though no tensor holds them; the tuned setting maps every buffer above 1 MiB on its own and returns it when freed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import tempfile
import threading
import time
from collections.abc import Iterator

import torch

import epmoe
from epmoe.bench import common
from epmoe.ep.state import sharded_experts
from epmoe.launch import run_ranks
from epmoe.models import build_model

VARIANTS = (
    "build then EP",
    "from_pretrained + EP",
    "epmoe.from_pretrained",
    "... packed layout",
    "... bf16 checkpoint",
    "save_pretrained",
)
CHECKPOINTS = {"... packed layout": "-packed", "... bf16 checkpoint": "-bf16"}  # the variant's path suffix
EP_SIZES = (2, 4)
ALLOCATORS = {"default": {}, "tuned": {"MALLOC_MMAP_THRESHOLD_": str(2**20)}}  # the ranks' malloc variables
MALLOC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "GLIBC_TUNABLES",
)


def headers(allocators: tuple[str, ...]) -> tuple[str, ...]:
    """The table's columns for the allocator settings measured (``ALLOCATORS``' names, in order)."""
    return (
        "EP size",
        "variant",
        "reference MiB",
        *(
            f"{what} ({allocator})"
            for allocator in allocators
            for what in ("private MiB", "private / ref", "RSS MiB", "RSS / ref")
        ),
        f"seconds ({allocators[0]})",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64, help="experts per MoE layer (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")


def model_kwargs(args: argparse.Namespace, quick: bool) -> dict:
    if quick:
        return dict(num_experts=8, num_hidden_layers=2, hidden_size=64, moe_intermediate_size=32)
    return dict(
        num_experts=args.experts,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        moe_intermediate_size=args.hidden,
        intermediate_size=4 * args.hidden,
        head_dim=args.hidden // 4,
    )


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("epmoe bench checkpoint needs transformers v5 (pip install 'epmoe[models]')") from None
    if not os.path.exists("/proc/self/status"):
        raise ValueError("epmoe bench checkpoint reads /proc/self/status: Linux only")
    settings = common.configure(args)
    # --quick: one EP size under the default allocator only, a smoke run of every variant
    allocators = ("default",) if settings.quick else tuple(ALLOCATORS)
    rows = measure(
        model_kwargs(args, settings.quick), EP_SIZES[:1] if settings.quick else EP_SIZES, allocators=allocators
    )
    columns = headers(allocators)
    table = common.markdown_table(columns, rows, align="ll" + "r" * (len(columns) - 2))
    print(table)
    if settings.out:
        with open(settings.out, "w") as out:
            out.write(_document(args, settings, table))
        print(f"\nwrote {settings.out}")
    return 0


def measure(kwargs: dict, ep_sizes, variants=VARIANTS, allocators=tuple(ALLOCATORS)) -> list[tuple]:
    """One row per (EP size, variant): the reference, then per allocator setting (``ALLOCATORS``)
    the peak private memory and peak resident set above the baseline, in MiB and over the reference,
    each the max over ranks; last the seconds under the first setting."""
    for allocator in allocators:
        if allocator not in ALLOCATORS:
            raise ValueError(f"measure(allocators): expected names from {tuple(ALLOCATORS)}, got {allocator!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="epmoe-bench-checkpoint-") as root:
        path = os.path.join(root, "model")
        model = build_model("qwen3_moe", **kwargs)
        model.save_pretrained(path)
        model.save_pretrained(path + CHECKPOINTS["... packed layout"], save_original_format=False)
        model.to(torch.bfloat16).save_pretrained(path + CHECKPOINTS["... bf16 checkpoint"])
        del model
        for ep_size in ep_sizes:
            for variant in variants:
                row, seconds = [], []
                for allocator in allocators:
                    with _allocator(ALLOCATORS[allocator]):
                        # fresh interpreters: glibc reads its malloc variables at process start
                        results = run_ranks(
                            _rank,
                            ep_size,
                            path,
                            kwargs,
                            variant,
                            os.path.join(root, "saved"),
                            threads_per_rank=1,
                            timeout=900,
                            start_method="spawn",
                        )
                    reference = max(r["reference"] for r in results)
                    for key in ("peak_anon", "peak_rss"):
                        peak = max(r[key] for r in results)
                        row += [f"{peak / 2**20:.1f}", f"{peak / reference:.2f}"]
                    seconds.append(max(r["seconds"] for r in results))
                rows.append((str(ep_size), variant, f"{reference / 2**20:.1f}", *row, f"{seconds[0]:.1f}"))
    return rows


@contextlib.contextmanager
def _allocator(variables: dict[str, str]) -> Iterator[None]:
    """The environment the ranks are spawned with: glibc's malloc variables exactly ``variables``."""
    saved = {key: os.environ.pop(key) for key in MALLOC_VARIABLES if key in os.environ}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key in variables:
            os.environ.pop(key, None)
        os.environ.update(saved)


class _Peak:
    """Samples ``RssAnon`` every 2 ms in a thread; ``peak`` is the highest seen (bytes)."""

    def __init__(self):
        self.peak, self._stop = _status("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


def _reset_peak_rss() -> int:
    """Resets ``VmHWM`` to the current resident set (``/proc/self/clear_refs``); returns that (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank(rank: int, world: int, path: str, kwargs: dict, variant: str, save_dir: str) -> dict:
    import gc

    from transformers import Qwen3MoeForCausalLM

    gc.collect()
    baseline, baseline_rss = _status("RssAnon"), _reset_peak_rss()
    sampler = _Peak()
    start = time.perf_counter()
    if variant == "build then EP":
        model = build_model("qwen3_moe", **kwargs)
        epmoe.apply_expert_parallel(model)
    elif variant == "from_pretrained + EP":
        model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
        epmoe.apply_expert_parallel(model)
    else:
        model, _ = epmoe.from_pretrained(Qwen3MoeForCausalLM, path + CHECKPOINTS.get(variant, ""), dtype=torch.float32)
        if variant == "save_pretrained":
            gc.collect()
            sampler.stop()
            baseline, baseline_rss = _status("RssAnon"), _reset_peak_rss()
            sampler, start = _Peak(), time.perf_counter()
            model.save_pretrained(save_dir)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    if variant == "save_pretrained":  # one experts module's weights, all E experts of one layer
        reference = max(
            sum(p.numel() * p.element_size() for p in state.sharded_params(module)) * state.shard.ep_size
            for _, module, state in sharded_experts(model)
        )
    else:  # local: non-experts + own experts
        reference = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "peak_anon": peak - baseline,
        "peak_rss": _status("VmHWM") - baseline_rss,
        "reference": reference,
        "seconds": seconds,
    }


def _document(args: argparse.Namespace, settings: common.Settings, table: str) -> str:
    import transformers

    extra = (
        ""
        if (args.experts, args.layers, args.hidden) == (64, 4, 256)
        else (f" --experts {args.experts} --layers {args.layers} --hidden {args.hidden}")
    )
    doc = __doc__.split("\n", 2)[2].strip().replace("``", "`").replace("::\n", ":\n")
    return f"""# Checkpoint memory benchmark: `epmoe bench checkpoint`

Reproduce (from the repository root, after `pip install -e '.[models]'`):

    epmoe bench checkpoint{" --quick" if settings.quick else ""}{extra}{" --out " + settings.out if settings.out else ""}

- Machine: {common.machine_description(torch.device("cpu"))}; transformers {transformers.__version__}.
- Run: {datetime.date.today().isoformat()}; one thread per rank.

{doc}

## Results

{table}
"""
