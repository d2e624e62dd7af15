"""Rank functions for tests/ep/test_replicas.py (module level, so spawned ranks can import them).

Expert replicas (``ExpertParallelConfig(replicas=N)``) against the same EP model without them and
the unsharded one, experts module and whole model. The cost model would move nothing at these small
test shapes on a CPU (the weights cost more to send than their rows to compute), so the exactness
runs set the CPU's exchange rate to zero (``free_link``): every imbalance then moves; one run keeps
the real rate and checks that nothing moves.
"""

from __future__ import annotations

import contextlib
import copy
import zlib

import torch
from ep_layer_workers import CASES_2, compare_case, experts_of, make_inputs

import epmoe
from epmoe import platform
from epmoe.ep import layer as layer_module
from epmoe.models import build_model

NUM_EXPERTS = 8
HIDDEN = 64

# routing cases: name -> (top_k, tokens per rank, kind, argument); "zipf": expert g drawn with weight 1/(g+1)^arg
SKEWED = {
    "zipf_k2": (2, [24, 17], "zipf", 1.5),
    "hot_expert_k2": (2, [20, 13], "one_expert", 1),
    "hot_rank_k4": (4, [16, 11], "avoid_rank", 1),  # every slot on rank 0's experts (at EP 2)
    "uniform_k2": (2, [16, 16], "random", None),
    "rank_with_zero_tokens": (2, [0, 21], "zipf", 2.0),
    "expert_without_tokens": (2, [18, 18], "skip_expert", 6),
}


@contextlib.contextmanager
def free_link():
    """The CPU's flops per link byte at zero: every imbalance is worth a move (see the module docstring)."""
    rates = platform._FLOPS_PER_LINK_BYTE
    saved = rates["cpu"]
    rates["cpu"] = 0.0
    try:
        yield
    finally:
        rates["cpu"] = saved


@contextlib.contextmanager
def recorded_plans():
    """Every replica plan the layers make inside the block (a list of the plans' moves)."""
    plans, plan = [], layer_module._replica_plan

    def record(*args, **kwargs):
        made = plan(*args, **kwargs)
        plans.append(() if made is None else made.moves)
        return made

    layer_module._replica_plan = record
    try:
        yield plans
    finally:
        layer_module._replica_plan = plan


def base_model():
    model = build_model("qwen3_moe", num_experts=NUM_EXPERTS, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for param in layer.mlp.experts.parameters():
                param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.1)
    return model


def module_cases(rank, world, cases, replicas=2):
    """Each routing case on the experts module with replicas, against the unsharded module and the
    same EP module without replicas: relative errors, and the moves each case's plan made."""
    model = base_model()
    ref = copy.deepcopy(experts_of(model))
    plain = copy.deepcopy(model)
    epmoe.apply_expert_parallel(model, config={"replicas": replicas})
    epmoe.apply_expert_parallel(plain)
    out = {}
    for name, case in cases.items():
        seed = zlib.crc32(name.encode())
        with free_link(), recorded_plans() as plans:
            errors, zeros = compare_case(
                name, case, ref, experts_of(model), list(range(world)), rank, torch.float64, seed
            )
        plain_errors, _ = compare_case(
            name, case, ref, experts_of(plain), list(range(world)), rank, torch.float64, seed
        )
        out[name] = {"errors": errors, "exact_zero": zeros, "plain": plain_errors, "moves": len(plans[0])}
    return out


def first_run(rank, world):
    return module_cases(rank, world, SKEWED)


__all__ = ["CASES_2", "make_inputs"]
