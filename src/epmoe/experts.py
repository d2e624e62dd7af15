"""Grouped experts compute: the local experts' MLP on rows already sorted by local expert.

    x_em (rows expert-major, counts[j] rows for local expert j)
      -> gate_up projection   grouped_mm(x_em, gate_up_proj)  (+ bias of each row's expert)
      -> gate / activation    module._apply_gate (SwiGLU, GPT-OSS clamped SwiGLU, ...) or act_fn
      -> down projection      grouped_mm(h, down_proj)        (+ bias; post-expert norm if any)
    y_em (same rows, same order)

Two kinds of experts modules are understood:

* Hugging Face transformers v5 packed experts (classes decorated with
  ``@use_experts_implementation``): 3-D ``gate_up_proj`` (or ``up_proj`` when ``has_gate`` is false)
  and ``down_proj``; ``is_transposed`` says whether they are ``(E, in, out)`` rather than the
  ``nn.Linear`` layout ``(E, out, in)``; ``has_bias`` adds ``*_proj_bias`` ``(E, out)``; the module's
  own ``_apply_gate`` / ``act_fn`` run as written (so interleaved gate/up such as GPT-OSS works).
  On an NPU the default SiLU gate runs as ``torch_npu.npu_swiglu``.
* ``nn.ModuleList`` of per-expert MLPs: with ``gate_proj`` / ``up_proj`` / ``down_proj`` (or Mixtral's
  ``w1`` / ``w3`` / ``w2``) bias-free ``nn.Linear`` layers and an ``act_fn``, the weights are stacked
  and run grouped; any other expert module is called on its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from epmoe import platform
from epmoe.gmm import GmmBackend, grouped_mm, select_backend

__all__ = ["experts_backend", "experts_forward", "gate_activation", "gmm_probe", "is_packed_experts", "num_experts_of"]

_LINEAR_TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def is_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers v5 packed experts module (``@use_experts_implementation``)."""
    if not all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed")):
        return False
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return all(isinstance(getattr(module, name, None), torch.Tensor) for name in (first, "down_proj"))


def num_experts_of(module: nn.Module) -> int:
    """Number of experts a packed or ``nn.ModuleList`` experts module holds now."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    return module.down_proj.shape[0]


def gmm_probe(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(x, weight, trans_weight)``: an empty input and the up projection's weight, laid out as
    :func:`experts_forward` passes them to ``grouped_mm`` (for asking which backend would run)."""
    if isinstance(module, nn.ModuleList):
        weight = next(module[0].parameters())  # stacked: (e, out, in), nn.Linear layout
        weight, trans_weight = weight.unsqueeze(0), True
    else:
        weight = module.gate_up_proj if module.has_gate else module.up_proj
        trans_weight = not module.is_transposed
    hidden = weight.shape[2] if trans_weight else weight.shape[1]
    return torch.empty(0, hidden, dtype=weight.dtype, device=weight.device), weight, trans_weight


def experts_backend(module: nn.Module, backend: str = "auto") -> GmmBackend:
    """The grouped-matmul backend :func:`experts_forward` runs ``module`` on (raises if a named one declines)."""
    x, weight, trans_weight = gmm_probe(module)
    return select_backend(x, weight, trans_weight=trans_weight, backend=backend)


def experts_forward(
    module: nn.Module, x_em: torch.Tensor, counts: Sequence[int], *, backend: str = "auto"
) -> torch.Tensor:
    """Run ``module``'s (local) experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``.

    ``x_em``: ``(A, H)``, rows expert-major. Returns ``(A, H)`` in the same order.
    """
    counts = list(counts)
    if len(counts) != num_experts_of(module):
        raise ValueError(f"experts_forward(counts): {len(counts)} counts for {num_experts_of(module)} experts")
    if isinstance(module, nn.ModuleList):
        return _module_list_forward(module, x_em, counts, backend)
    return _packed_forward(module, x_em, counts, backend)


def _row_bias(bias_EN: torch.Tensor, counts: list[int], num_rows: int) -> torch.Tensor:
    """``(A, N)``: each row's expert bias (an index gather; its backward is index_put)."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts), output_size=num_rows)
    return bias_EN[platform.host_to_device(expert_of_row, bias_EN.device)]


def _is_default_silu_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    return (
        getattr(gate, "__name__", "") == "_default_apply_gate"
        and getattr(gate, "__module__", "") == "transformers.integrations.moe"
        and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
    )


def gate_activation(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The packed experts' gate (``_apply_gate``) or activation (``act_fn``) on ``h``; ``npu_swiglu`` on an NPU."""
    if not module.has_gate:
        return module.act_fn(h)
    if platform.device_type(h) == "npu" and _is_default_silu_gate(module):
        return platform.torch_npu().npu_swiglu(h, dim=-1)
    return module._apply_gate(h)


def _packed_forward(module: nn.Module, x_em: torch.Tensor, counts: list[int], backend: str) -> torch.Tensor:
    trans_weight = not module.is_transposed  # nn.Linear layout (E, out, in) is our "transposed"
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    num_rows = x_em.shape[0]
    h = grouped_mm(x_em, getattr(module, up_name), counts, trans_weight=trans_weight, backend=backend)
    if module.has_bias:
        h = h + _row_bias(getattr(module, f"{up_name}_bias"), counts, num_rows)
    h = gate_activation(module, h)
    y = grouped_mm(h, module.down_proj, counts, trans_weight=trans_weight, backend=backend)
    if module.has_bias:
        y = y + _row_bias(module.down_proj_bias, counts, num_rows)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y


def _linear_triple(expert: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    for names in _LINEAR_TRIPLES:
        layers = [getattr(expert, name, None) for name in names]
        if all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers) and hasattr(expert, "act_fn"):
            return tuple(layers)
    return None


def _module_list_forward(experts: nn.ModuleList, x_em: torch.Tensor, counts: list[int], backend: str) -> torch.Tensor:
    triples = [_linear_triple(expert) for expert in experts]
    if triples and all(t is not None for t in triples):
        gate_w = torch.stack([t[0].weight for t in triples])  # (e, I, H), nn.Linear layout
        up_w = torch.stack([t[1].weight for t in triples])
        down_w = torch.stack([t[2].weight for t in triples])  # (e, H, I)
        gate_up_w = torch.cat([gate_w, up_w], dim=1)  # (e, 2I, H)
        gate, up = grouped_mm(x_em, gate_up_w, counts, trans_weight=True, backend=backend).chunk(2, dim=-1)
        h = experts[0].act_fn(gate) * up
        return grouped_mm(h, down_w, counts, trans_weight=True, backend=backend)
    outputs, start = [], 0
    for expert, n in zip(experts, counts):
        if n:
            outputs.append(expert(x_em[start:start + n]))
        start += n
    if not outputs:  # stay connected to x_em: its exchange must run in backward on every rank
        return x_em * 0
    return torch.cat(outputs)
