"""Activation memory of ``experts_implementation="epmoe"`` against transformers' ``grouped_mm``, measured.

    epmoe bench experts [--tokens 512] [--out benchmarks/experts_implementation_cpu.md]
    epmoe bench experts --quick --json      # a tiny shape, one JSON line

One ``Qwen3MoeSparseMoeBlock`` at Qwen3-30B-A3B's shapes (E=128 experts, top-8, H=2048, I=768; its own
router: softmax, top-k, renormalised; SwiGLU experts), random weights (std 0.02), float32, on the
CPU. Its config switches between the two implementations (what ``model.set_experts_implementation``
does), so both run the same weights on the same tokens. For each, what autograd keeps for backward in
one forward (``torch.autograd.graph.saved_tensors_hooks``: the unique storages of the saved tensors,
parameters excluded, whole), in bytes per token:

* the experts module alone: ``block.experts(hidden, top_k_index, top_k_weights)`` on the block's
  input and its router's routing (input and routing weights requiring gradients, as in training);
  epmoe's count includes the hidden states themselves (the block input, which the router keeps
  anyway), grouped_mm's keeps only their indices;
* the whole block (router included).

Then the block's output and every gradient of one forward + backward (input, routing and expert
weights) compared between the two. Goal: epmoe's experts keep at most 0.35x grouped_mm's bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from epmoe.bench.blocks import GROUPED, Shape, build_blocks
from epmoe.bench.common import machine_description, markdown_table
from epmoe.integrations import transformers_experts

GOAL = 0.35  # epmoe's experts' saved bytes / grouped_mm's <=
IMPLEMENTATIONS = ("grouped_mm", "epmoe")


def qwen3_30b_a3b(tokens: int) -> Shape:
    return Shape("Qwen3-30B-A3B", num_experts=128, top_k=8, hidden=2048, intermediate=768, tokens=tokens)


QUICK = Shape("tiny, K=8", num_experts=32, top_k=8, hidden=64, intermediate=24, tokens=64)


def saved_bytes(module: torch.nn.Module, run) -> int:
    """The bytes autograd keeps for backward while ``run()`` runs a forward of ``module``: the unique
    storages of the saved tensors, ``module``'s parameters excluded; the graph is then freed."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(kept.values())


def measure(shape: Shape, seed: int = 0) -> dict:
    """Saved bytes per token of the experts module and of the block for each implementation, and the
    largest difference between them in the block's output and gradients."""
    block = build_blocks(shape, seed, torch.device("cpu"), variants=(GROUPED,))[GROUPED]
    generator = torch.Generator().manual_seed(seed + 1)
    x_TH = torch.randn(shape.tokens, shape.hidden, generator=generator)
    dy_TH = torch.randn(shape.tokens, shape.hidden, generator=generator)
    with torch.no_grad():
        _, weights_TK, index_TK = block.gate(x_TH)
    per_token = {}
    results = {}
    for name in IMPLEMENTATIONS:
        block.experts.config._experts_implementation = name
        x = x_TH.clone().requires_grad_()
        w = weights_TK.clone().requires_grad_()
        experts_bytes = saved_bytes(block.experts, lambda: block.experts(x, index_TK, w))
        block_bytes = saved_bytes(block, lambda: block(x.view(1, *x.shape)))
        per_token[name] = {"experts": experts_bytes / shape.tokens, "block": block_bytes / shape.tokens}
        block.zero_grad(set_to_none=True)
        x = x_TH.clone().requires_grad_()
        out = block(x.view(1, *x.shape))
        out.backward(dy_TH.view(1, *dy_TH.shape))
        results[name] = [out.detach(), x.grad] + [p.grad for p in block.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(*results.values()))
    scale = max(a.abs().max().item() for a in results["grouped_mm"])
    ratio = {part: per_token["epmoe"][part] / per_token["grouped_mm"][part] for part in ("experts", "block")}
    return {"shape": vars(shape), "bytes_per_token": per_token, "ratio": ratio, "max_abs_diff": diff, "max_abs": scale}


def markdown(result: dict, command: str) -> str:
    shape = Shape(**result["shape"])
    H, I, K = shape.hidden, shape.intermediate, shape.top_k
    per_token, ratio = result["bytes_per_token"], result["ratio"]
    met = "met" if ratio["experts"] <= GOAL else "not met"
    rows = [
        (part, f"{per_token['grouped_mm'][part]:.0f}", f"{per_token['epmoe'][part]:.0f}", f"{ratio[part]:.3f}")
        for part in ("experts", "block")
    ]
    return "\n".join(
        [
            '# `experts_implementation="epmoe"`: activation memory against `grouped_mm`',
            "",
            "Reproduce (from the repository root, after `pip install -e '.[models]'`):",
            "",
            f"    {command}",
            "",
            f"- Machine: {machine_description()}; transformers {__import__('transformers').__version__}; float32.",
            f"- Shape: {shape.name}, {shape.describe()}; one `Qwen3MoeSparseMoeBlock`, its own router, random "
            "weights (std 0.02); the config switched between the implementations, same weights, same tokens.",
            "- Measured: what autograd keeps for backward in one forward (`torch.autograd.graph.saved_tensors_hooks`, "
            "unique storages of the saved tensors, parameters excluded), bytes per token. experts: the experts "
            "module alone, called with the block input and its router's routing (both requiring gradients); "
            "epmoe's count includes the block input itself, which the router keeps too. block: the whole block.",
            "",
            markdown_table(
                ("kept for backward", "grouped_mm B/token", "epmoe B/token", "epmoe / grouped_mm"), rows, align="lrrr"
            ),
            "",
            f"- For reference, the experts' formulas in fp32 bytes per token: plain autograd 4K(2H + 4I) = "
            f"{4 * K * (2 * H + 4 * I)}, epmoe's bound 4(H + 2KI) = {4 * (H + 2 * K * I)} (plus the routing indices "
            "and weights).",
            f"- Goal: the experts keep at most {GOAL}x grouped_mm's bytes: **{met}** ({ratio['experts']:.3f}x).",
            f"- Output and gradients of one block forward + backward (input, router, experts), epmoe against "
            f"grouped_mm: largest absolute difference {result['max_abs_diff']:.2e} (largest value "
            f"{result['max_abs']:.2e}).",
            "",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the block's batch (default: 512)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")


def run(args: argparse.Namespace) -> int:
    if transformers_experts.ExpertsInterface is None:
        raise SystemExit("transformers with an ExpertsInterface is needed")
    shape = QUICK if args.quick else qwen3_30b_a3b(args.tokens)
    result = measure(shape, args.seed)
    if args.json:
        print(json.dumps(result))
        return 0
    text = markdown(result, " ".join(["epmoe bench experts", *sys.argv[3:]]))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0
