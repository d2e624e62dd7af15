"""The MoE blocks, models and shapes ``epmoe bench layer`` measures (its parts ep1, ep2, compile and
lean), and the steps it times: a block's forward + backward, a model's forward + backward."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import epmoe
from epmoe.launch import run_ranks
from epmoe.models import build_model

EAGER, GROUPED, EPMOE, DENSE = "transformers eager", "transformers grouped_mm", "epmoe", "dense floor"
BLOCK_VARIANTS = (EAGER, GROUPED, EPMOE)
IMPLEMENTATIONS = {EAGER: "eager", GROUPED: "grouped_mm", EPMOE: "eager"}  # config._experts_implementation
EP2_RANKS = 2


@dataclass(frozen=True)
class Shape:
    """One MoE block: ``tokens`` tokens routed top-``top_k`` over ``num_experts`` SwiGLU experts."""

    name: str
    num_experts: int  # E
    top_k: int  # K
    hidden: int  # H
    intermediate: int  # I, per expert (gate_up has 2I outputs)
    tokens: int  # T

    @property
    def rows(self) -> int:
        """``S = T * K``: the rows the experts run on."""
        return self.tokens * self.top_k

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs of the expert GEMMs: gate_up ``(S,H)x(H,2I)``, down ``(S,I)x(I,H)``, 3x."""
        return 3 * 2.0 * self.rows * (self.hidden * 2 * self.intermediate + self.intermediate * self.hidden)

    def describe(self) -> str:
        return (
            f"E={self.num_experts}, top-{self.top_k}, H={self.hidden}, I={self.intermediate}, "
            f"T={self.tokens} tokens ({self.rows // self.num_experts} rows per expert on average)"
        )


SHAPES = (
    Shape("32 experts", num_experts=32, top_k=4, hidden=1024, intermediate=512, tokens=1024),
    Shape("128 experts", num_experts=128, top_k=8, hidden=1024, intermediate=256, tokens=1024),
)
QUICK_SHAPES = (Shape("tiny", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=64),)
EP2_LAYERS = 1  # decoder layers of the EP=2 model (a MoE layer)


def build_blocks(
    shape: Shape,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    variants: tuple[str, ...] = BLOCK_VARIANTS,
) -> dict[str, torch.nn.Module]:
    """``{variant: Qwen3MoeSparseMoeBlock}`` for each of ``variants`` (``EAGER``, ``GROUPED``,
    ``EPMOE``), with identical weights whichever are built (drawn from ``seed``). The epmoe copy goes
    through ``epmoe.apply_expert_parallel(block)``: EP size 1 without a process group, the default
    group's size under one (each rank then holds its slice of the experts)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    unknown = sorted(set(variants) - set(BLOCK_VARIANTS))
    if unknown or not variants:
        raise ValueError(f"build_blocks(variants): expected some of {list(BLOCK_VARIANTS)}, got {list(variants)}")

    def block(variant: str) -> torch.nn.Module:
        config = transformers.Qwen3MoeConfig(
            hidden_size=shape.hidden,
            moe_intermediate_size=shape.intermediate,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k,
            norm_topk_prob=True,
        )
        config._experts_implementation = IMPLEMENTATIONS[variant]  # each copy its own config: experts keep a reference
        return Qwen3MoeSparseMoeBlock(config)

    generator = torch.Generator().manual_seed(seed)
    first, *others = variants
    reference = block(first)
    with torch.no_grad():  # a bare block is not initialised by from_pretrained: weights are torch.empty
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    blocks = {first: reference.to(device, dtype)}
    for variant in others:
        blocks[variant] = block(variant).to(device, dtype)
        blocks[variant].load_state_dict(reference.state_dict())
    if EPMOE in blocks:
        epmoe.apply_expert_parallel(blocks[EPMOE])
    return {variant: blocks[variant] for variant in BLOCK_VARIANTS if variant in blocks}


def block_step(block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    params = list(block.parameters())

    def step() -> torch.Tensor:
        for param in params:
            param.grad = None
        x_leaf = x.detach().requires_grad_()
        out = block(x_leaf)
        torch.autograd.backward(out, dy)
        return out

    return step


def ep2_model_kwargs(shape: Shape) -> dict:
    """``epmoe.models.build_model`` arguments of the EP=2 model: the shape's experts, small attention."""
    return dict(
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.intermediate,
        num_hidden_layers=EP2_LAYERS,
    )


def run_on_saved_model(rank_fn: Callable, ranks: int, shape: Shape, settings) -> tuple[list, int]:
    """``(each rank's result, threads per rank)``: a one-layer Qwen3-MoE model of ``shape``'s experts
    saved with ``save_pretrained``, then ``rank_fn(rank, world, path, tokens, warmup, repeats, seed)``
    on ``ranks`` spawned gloo ranks sharing ``settings.threads``."""
    threads = max(1, settings.threads // ranks)
    with tempfile.TemporaryDirectory(prefix="epmoe-bench-") as path:
        build_model("qwen3_moe", seed=settings.seed, **ep2_model_kwargs(shape)).save_pretrained(path)
        results = run_ranks(
            rank_fn,
            ranks,
            path,
            shape.tokens,
            settings.warmup,
            settings.repeats,
            settings.seed,
            threads_per_rank=threads,
            timeout=900,
        )
    return results, threads


def load_causal_lm(path: str, **kwargs) -> torch.nn.Module:
    """The model saved at ``path`` in float32, its experts on transformers' ``grouped_mm``
    (``kwargs``: more ``from_pretrained`` arguments, e.g. a ``distributed_config``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="grouped_mm", **kwargs
    )


def model_step(
    model: torch.nn.Module, ids: torch.Tensor, balancer=None, extra_seconds: list | None = None
) -> Callable[[], float]:
    """Forward and backward of ``model`` on ``ids`` (labels = ids), returning the loss (DDP
    synchronises the gradients inside the backward); with a ``balancer``, then the step's expert
    load read and reset and the balancer's update, whose own seconds are appended to
    ``extra_seconds`` (timed inside the step)."""

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        if balancer is not None:
            start = time.perf_counter()
            epmoe.expert_load(model.module)
            epmoe.reset_expert_load(model.module)
            balancer.step()
            extra_seconds.append(time.perf_counter() - start)
        return loss.item()

    return step
