"""The MoE blocks and shapes ``epmoe bench layer`` measures (its parts ep1, ep2 and compile)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import epmoe

EAGER, GROUPED, EPMOE, DENSE = "transformers eager", "transformers grouped_mm", "epmoe", "dense floor"
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
        return (f"E={self.num_experts}, top-{self.top_k}, H={self.hidden}, I={self.intermediate}, "
                f"T={self.tokens} tokens ({self.rows // self.num_experts} rows per expert on average)")


SHAPES = (
    Shape("32 experts", num_experts=32, top_k=4, hidden=1024, intermediate=512, tokens=1024),
    Shape("128 experts", num_experts=128, top_k=8, hidden=1024, intermediate=256, tokens=1024),
)
QUICK_SHAPES = (Shape("tiny", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=64),)
EP2_LAYERS = 1  # decoder layers of the EP=2 model (a MoE layer)


def build_blocks(shape: Shape, seed: int, device: torch.device, dtype: torch.dtype = torch.float32):
    """``{variant: Qwen3MoeSparseMoeBlock}``: eager, grouped_mm and epmoe copies with identical weights."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    def block(implementation: str) -> torch.nn.Module:
        config = transformers.Qwen3MoeConfig(
            hidden_size=shape.hidden, moe_intermediate_size=shape.intermediate, num_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k, norm_topk_prob=True)
        config._experts_implementation = implementation  # each copy its own config: experts keep a reference
        return Qwen3MoeSparseMoeBlock(config)

    generator = torch.Generator().manual_seed(seed)
    reference = block("eager")
    with torch.no_grad():  # a bare block is not initialised by from_pretrained: weights are torch.empty
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    reference = reference.to(device, dtype)
    blocks = {EAGER: reference}
    for label, implementation in ((GROUPED, "grouped_mm"), (EPMOE, "eager")):
        blocks[label] = block(implementation).to(device, dtype)
        blocks[label].load_state_dict(reference.state_dict())
    epmoe.apply_expert_parallel(blocks[EPMOE])
    return blocks


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
    return dict(num_experts=shape.num_experts, top_k=shape.top_k, hidden_size=shape.hidden,
                moe_intermediate_size=shape.intermediate, num_hidden_layers=EP2_LAYERS)
