"""Rank functions of the migration from transformers' own expert parallelism (module level, so spawned
ranks can import them): the same ``DistributedConfig`` given to ``epmoe.from_pretrained`` trains
exactly like the unsharded model, and a model transformers sharded at load is refused by
``apply_expert_parallel``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import epmoe
from epmoe.bench.versus import _load, _rel, _train


def migrated(path: str, ep_size: int, world: int, implementation: str = "auto") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model, shards = epmoe.from_pretrained(
        AutoModelForCausalLM,
        path,
        dtype=torch.float64,
        experts_implementation="eager",
        distributed_config=DistributedConfig(ep_size=ep_size, fsdp_size=world, ep_implementation=implementation),
    )
    assert shards[0].num_local_experts * ep_size == shards[0].num_experts
    return model


def exact(rank: int, world: int, path: str, ep_size: int, implementation: str = "auto") -> dict:
    """``{"loss": ..., "grads": ...}``: the largest relative differences over 5 AdamW steps (fp64,
    ranks' batches of different lengths) from the unsharded model, gradients averaged over ranks;
    ``implementation``: the config's ``ep_implementation``."""
    ref = _train(_load(path, dtype=torch.float64), rank, 0, reduce=True)
    got = _train(migrated(path, ep_size, world, implementation), rank, 0, reduce=False)
    return {
        "loss": max(map(_rel, got["loss"], ref["loss"])),
        "grads": max(
            _rel(step[name], ref_step[name]) for step, ref_step in zip(got["grads"], ref["grads"]) for name in ref_step
        ),
        "compared": len(ref["grads"][0]),
    }


def refusals(rank: int, world: int, path: str) -> dict:
    """``{case: the ValueError's message, or "no error"}``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    out = {}
    loaded = _load(path, world)  # transformers' own EP

    def attempt(case, fn):
        try:
            fn()
            out[case] = "no error"
        except (ValueError, TypeError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"

    attempt("apply_expert_parallel", lambda: epmoe.apply_expert_parallel(loaded))
    out["still transformers'"] = epmoe.ep_model(loaded) is None
    for case, config in (
        ("tp_size", DistributedConfig(ep_size=2, tp_size=2, fsdp_size=1)),
        ("ep_implementation", DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_reduce")),
        ("fsdp_size", DistributedConfig(ep_size=2, fsdp_size=2 * world)),
    ):
        attempt(
            case, lambda config=config: epmoe.from_pretrained(AutoModelForCausalLM, path, distributed_config=config)
        )
    attempt(
        "not a DistributedConfig",
        lambda: epmoe.from_pretrained(AutoModelForCausalLM, path, distributed_config={"ep_size": 2}),
    )
    dist.barrier()
    return out


def two_ranks(rank: int, world: int, path: str) -> dict:
    return {
        "exact": exact(rank, world, path, world),
        # a config written for transformers' EP with epmoe's exchange inside it moves over unchanged
        "exact with ep_implementation='epmoe'": exact(rank, world, path, world, "epmoe"),
        "refusals": refusals(rank, world, path),
    }
