"""Rank functions for tests/models/test_transformers_ep.py: transformers' own expert parallelism with
``ep_implementation="epmoe"`` against the same load with ``"all_to_all"``, on spawned gloo ranks."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import epmoe  # noqa: F401 - registers ep_implementation="epmoe"
from epmoe.bench.versus import _rel, _train
from epmoe.integrations import transformers_ep

# configured registrations the cases load with (registered on each rank, as a user would)
CONFIGURED = {
    "epmoe-static": {"dispatch": "static", "static_tokens": 64, "check_steps": False},
    "epmoe-capacity": {"capacity_factor": 1.0},
}


def load(path: str, implementation: str, dtype: torch.dtype, ep_size: int, fsdp_size: int) -> torch.nn.Module:
    """The saved model through transformers' own EP, its experts exchanged by ``implementation``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if implementation in CONFIGURED:
        transformers_ep.register(implementation, CONFIGURED[implementation])
    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        experts_implementation="eager" if dtype == torch.float64 else "grouped_mm",  # grouped_mm takes no float64
        distributed_config=DistributedConfig(ep_size=ep_size, fsdp_size=fsdp_size, ep_implementation=implementation),
    )


def _skewed(model: torch.nn.Module) -> None:
    """Every router's weights zero: every token picks the same K experts (topk's ties), all on one EP
    rank: the other rank receives nothing and most experts get no token."""
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        for router in routers:
            router.weight.zero_()
        weight = routers[0].weight.full_tensor()  # FSDP2 shards it
        scores = torch.softmax(torch.randn(6, weight.shape[1], dtype=weight.dtype) @ weight.T, dim=-1)
        index_TK = torch.topk(scores, model.config.num_experts_per_tok).indices  # what the router picks
    assert (index_TK // (model.config.num_experts // 2)).unique().numel() == 1, index_TK  # one EP rank's experts


def compared(
    rank: int, path: str, dtype: torch.dtype, ep_size: int, world: int, variant: str, implementation: str = "epmoe"
) -> dict:
    """``{"loss": ..., "grads": ..., "compared": n}``: the largest relative differences of ``"epmoe"``
    from ``"all_to_all"`` over a few AdamW steps (every parameter's whole gradient), ranks' batches
    of different lengths; ``variant``: ``"plain"``, ``"checkpointing"`` (gradient checkpointing on),
    ``"skewed"`` (routers zeroed: one rank receives every token)."""
    runs = {}
    for name in ("all_to_all", implementation):
        model = load(path, name, dtype, ep_size, world)
        if variant == "checkpointing":
            model.gradient_checkpointing_enable()
        if variant == "skewed":
            _skewed(model)
        runs[name] = _train(model, rank, 0, reduce=False)
    ref, got = runs["all_to_all"], runs[implementation]
    return {
        "loss": max(map(_rel, got["loss"], ref["loss"])),
        "grads": max(_rel(s[n], r[n]) for s, r in zip(got["grads"], ref["grads"]) for n in r),
        "compared": len(ref["grads"][0]),
    }


def generated(rank: int, path: str, ep_size: int, world: int, implementation: str = "epmoe") -> bool:
    """Whether greedy ``generate`` gives the same tokens with ``implementation`` as with ``"all_to_all"``
    (ranks with prompts of different lengths)."""
    g = torch.Generator().manual_seed(11 + rank)
    prompt = torch.randint(0, 200, (1, 4 + 3 * rank), generator=g)
    tokens = {}
    for name in ("all_to_all", implementation):
        model = load(path, name, torch.float64, ep_size, world).eval()
        with torch.no_grad():
            tokens[name] = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    return torch.equal(tokens["all_to_all"], tokens[implementation])


def cases(rank: int, world: int, runs: dict) -> dict:
    """Every case of ``runs`` (``{label: (kind, arguments)}``) on these ranks: ``{label: result}``, a
    case that raised as ``{"error": traceback}`` (the others still run)."""
    out = {}
    for label, (kind, args) in runs.items():
        try:
            out[label] = KINDS[kind](rank, *args)
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            out[label] = {"error": traceback.format_exc()[-3000:]}
        dist.barrier()
    return out


def refused(rank: int, world: int, path: str) -> dict:
    """``{case: the error it raises at load on this rank, or "no error"}``: a TP mesh with
    ``ep_implementation="epmoe"``, and an implementation registered with ``capacity_factor``."""
    from transformers.distributed import DistributedConfig

    out = {}
    for case, loading in (
        (
            "tp mesh",
            lambda: load_with(path, DistributedConfig(ep_size=2, tp_size=2, fsdp_size=1, ep_implementation="epmoe")),
        ),
        ("capacity_factor", lambda: load(path, "epmoe-capacity", torch.float32, 2, 2)),
    ):
        try:
            loading()
            out[case] = "no error"
        except ValueError as exc:
            out[case] = f"ValueError: {exc}"
        dist.barrier()
    return out


def load_with(path: str, config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config)


def inference_reads(rank: int, path: str, implementation: str) -> dict:
    """Host reads and whether the output is right (to float32 rounding), of one experts module's
    decode-sized inference call (its second: the first sets it up) under ``implementation``, against
    ``"all_to_all"``'s. float32: the grouped matmuls take their counts on the device (float64's
    ``loop`` backend reads them)."""
    from host_reads import counting_host_reads

    g = torch.Generator().manual_seed(5 + rank)
    outs, reads = {}, {}
    for name in ("all_to_all", implementation):
        model = load(path, name, torch.float32, 2, 2)
        experts = model.model.layers[0].mlp.experts
        E, K = model.config.num_experts, model.config.num_experts_per_tok
        x = torch.randn(3 + rank, model.config.hidden_size, generator=g)
        index = torch.rand(x.shape[0], E, generator=g).argsort(dim=1)[:, :K]
        weights = torch.softmax(torch.randn(x.shape[0], K, generator=g), dim=-1)
        with torch.no_grad():
            experts(x, index, weights)
            with counting_host_reads() as calls:
                outs[name] = experts(x, index, weights)
        reads[name] = len(calls)
        g = torch.Generator().manual_seed(5 + rank)  # the same tokens for both
    return {"reads": reads[implementation], "equal": _rel(outs[implementation], outs["all_to_all"]) <= 1e-5}


KINDS = {"compared": compared, "generated": generated, "inference_reads": inference_reads}
