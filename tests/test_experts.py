"""Grouped experts compute (epmoe.experts) against transformers' own per-expert eager forward."""

import pytest
import torch

from epmoe import experts as experts_mod
from epmoe.experts import experts_forward, gate_activation
from epmoe.models import build_model
from npu_emulation import install


def packed_experts(family):
    model = build_model(family, dtype=torch.float64)
    return next(m for m in model.modules() if experts_mod.is_packed_experts(m))


def eager_per_expert(module, x_em, counts):
    """transformers' eager experts forward, one expert at a time with weight 1."""
    out, start = [], 0
    for j, n in enumerate(counts):
        rows = x_em[start:start + n]
        index = torch.full((n, 1), j, dtype=torch.long)
        out.append(type(module).forward(module, rows, index, torch.ones(n, 1, dtype=rows.dtype)))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("counts", [[5, 0, 3, 9, 0, 1, 2, 4], [24, 0, 0, 0, 0, 0, 0, 0]], ids=["mixed", "one_expert"])
def test_packed_experts_match_eager(family, counts):
    """Every flag of @use_experts_implementation: Linear layout, transposed + interleaved gate/up +
    biases + clamped SwiGLU (GPT-OSS), output and gradients of input and every weight."""
    module = packed_experts(family)
    x = torch.randn(sum(counts), module.down_proj.shape[1 if not module.is_transposed else 2],
                    dtype=torch.float64, requires_grad=True)
    y = experts_forward(module, x, counts)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    y_ref = eager_per_expert(module, x, counts)
    grads_ref = torch.autograd.grad(y_ref, [x, *module.parameters()], dy, allow_unused=True)
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if g_ref is None else g_ref)


def test_experts_forward_validates_counts():
    with pytest.raises(ValueError, match="3 counts for 8 experts"):
        experts_forward(packed_experts("qwen3_moe"), torch.zeros(3, 64, dtype=torch.float64), [1, 1, 1])


def test_npu_uses_swiglu_only_for_the_default_silu_gate(monkeypatch):
    """On an NPU, the default SiLU gate runs as torch_npu.npu_swiglu; a custom gate (GPT-OSS) runs as written."""
    fake = install(monkeypatch)
    monkeypatch.setattr(experts_mod.platform, "device_type", lambda obj=None: "npu")
    qwen, gpt = packed_experts("qwen3_moe"), packed_experts("gpt_oss")
    qwen, gpt = qwen.float(), gpt.float()
    h = torch.randn(4, 2 * 32)
    torch.testing.assert_close(gate_activation(qwen, h), qwen._apply_gate(h))
    assert len(fake.swiglu_calls) == 1
    torch.testing.assert_close(gate_activation(gpt, h), gpt._apply_gate(h))
    assert len(fake.swiglu_calls) == 1
