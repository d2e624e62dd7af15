"""DeepSpeed ZeRO-3 against ZeRO-2 on the same EP run: step time and memory per rank, side by side.

    python benchmarks/zero3.py [--ranks 2] [--mesh] [--steps 10] [--out benchmarks/zero3_cpu.md]

A Qwen3-MoE of ``epmoe.models`` (fp32; 4 layers, hidden 256, 32 experts of width 256, vocab 2048), made
expert-parallel over ``--ranks`` gloo ranks (``--mesh``: an EP 2 x DP ranks/2 mesh), prepared with
``epmoe.prepare_deepspeed`` and trained by ``deepspeed.initialize`` (AdamW, ``gradient_clipping`` 1.0)
at ZeRO stage 2 and at stage 3 (every parameter partitioned: ``stage3_param_persistence_threshold`` 0),
``4 x 128`` tokens per rank and step.

* Step time: both engines in one spawn, their steps (forward, backward, step) interleaved round by
  round (``epmoe.bench.common.measure``: median, the slowest rank's).
* Memory per rank, from the storages each engine holds after its steps (each counted once): the
  model's parameters as they sit between steps (ZeRO-3: the rank's partitions), the optimizer's float32
  master partitions (where not the parameters' own storage) and its Adam moments; and the peak
  resident set size of a rank that ran only that stage (one spawn per stage, ``ru_maxrss``; on CPU it
  includes the Python, torch and DeepSpeed runtime).
"""

from __future__ import annotations

import argparse
import os
import resource

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import epmoe  # noqa: E402
from epmoe.bench.common import load_average, machine_description, markdown_table, measure  # noqa: E402
from epmoe.launch import run_ranks  # noqa: E402
from epmoe.models import build_model  # noqa: E402

MODEL = dict(
    num_experts=32,
    hidden_size=256,
    moe_intermediate_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    vocab_size=2048,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
)
TOKENS = (4, 128)
MIB = 2**20


def _config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": TOKENS[0],
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _engine(stage: int, mesh: bool):
    import deepspeed

    torch.manual_seed(0)
    model = build_model("qwen3_moe", **MODEL)
    group = None
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (torch.distributed.get_world_size() // 2, 2), mesh_dim_names=("dp", "ep"))
    epmoe.apply_expert_parallel(model, group)
    epmoe.prepare_deepspeed(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=_config(stage)
    )
    return engine


def _step(engine, ids: torch.Tensor) -> None:
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()


def _held_mib(engine) -> dict:
    """What the engine holds between steps, in MiB: the model's parameters (ZeRO-3: this rank's
    partitions), the optimizer's float32 master partitions (where not the parameters' own storage) and
    its state (Adam's moments)."""
    params = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]
    inner = engine.optimizer.optimizer
    master = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 (its groups: only in step)
    if master is None:
        master = [p for group in inner.param_groups for p in group["params"]]
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    seen: set[int] = set()

    def mib(tensors: list) -> float:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total / MIB

    return {"params": mib(params), "master": mib(master), "state": mib(state)}


def _ids(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(rank))


def _side_by_side(rank: int, world: int, mesh: bool, steps: int) -> dict:
    torch.set_num_threads(1)
    engines = {f"ZeRO-{stage}": _engine(stage, mesh) for stage in (2, 3)}
    ids = _ids(rank, MODEL["vocab_size"])
    timings = measure(
        {name: (lambda e=engine: _step(e, ids)) for name, engine in engines.items()},
        warmup=2,
        repeats=steps,
        ranks=True,
    )
    return {name: {"ms": timings[name].median_s * 1e3, **_held_mib(engine)} for name, engine in engines.items()}


def _alone(rank: int, world: int, mesh: bool, stage: int, steps: int) -> float:
    """Peak RSS (MiB) of a rank that builds and trains the stage's engine only."""
    torch.set_num_threads(1)
    engine = _engine(stage, mesh)
    ids = _ids(rank, MODEL["vocab_size"])
    for _ in range(steps):
        _step(engine, ids)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mesh", action="store_true", help="EP 2 x DP ranks/2 instead of EP over every rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.ranks < 2 or (args.mesh and args.ranks % 2):
        raise ValueError(f"--ranks: expected >= 2 (even with --mesh), got {args.ranks}")
    by_rank = run_ranks(_side_by_side, args.ranks, args.mesh, args.steps, timeout=1800)
    peaks = {
        f"ZeRO-{stage}": max(run_ranks(_alone, args.ranks, args.mesh, stage, args.steps, timeout=1800))
        for stage in (2, 3)
    }
    rows = []
    for name in ("ZeRO-2", "ZeRO-3"):
        worst = {key: max(r[name][key] for r in by_rank) for key in ("ms", "params", "master", "state")}
        held = worst["params"] + worst["master"] + worst["state"]
        rows.append(
            [
                name,
                f"{worst['ms']:.1f}",
                f"{worst['params']:.2f}",
                f"{worst['master']:.2f}",
                f"{worst['state']:.2f}",
                f"{held:.2f}",
                f"{peaks[name]:.0f}",
            ]
        )
    layout = f"EP 2 x DP {args.ranks // 2}" if args.mesh else f"EP {args.ranks}"
    table = markdown_table(
        ["stage", "step ms (median)", "params MiB", "fp32 master MiB", "Adam state MiB", "held MiB", "peak RSS MiB"],
        rows,
    )
    command = f"python benchmarks/zero3.py --ranks {args.ranks}{' --mesh' if args.mesh else ''} --steps {args.steps}"
    text = (
        f"## {layout}\n\nReproduce: `{command}`\n\n- Machine: {machine_description()}; load average "
        f"{load_average()}.\n- Qwen3-MoE (epmoe.models, fp32, {MODEL}), {layout} over {args.ranks} gloo "
        f"ranks, `epmoe.prepare_deepspeed` + `deepspeed.initialize` (AdamW), {TOKENS[0]} x {TOKENS[1]} "
        f"tokens per rank and step, one thread per rank. Step: the slowest rank's median of {args.steps} "
        f"interleaved rounds. Memory: the largest over ranks; held = params + fp32 master + Adam state (storages "
        f"counted once); peak RSS: a rank that ran only that stage (runtime included).\n\n"
        f"{table}\n"
    )
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
