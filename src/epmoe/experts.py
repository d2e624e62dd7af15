"""Grouped experts compute: the local experts' MLP on rows already sorted by local expert.

    x_em (rows expert-major, counts[j] rows for local expert j)
      -> gate_up projection   grouped_mm(x_em, gate_up_proj)  (+ bias of each row's expert)
      -> gate / activation    module._apply_gate (SwiGLU, GPT-OSS clamped SwiGLU, ...) or act_fn
      -> down projection      grouped_mm(h, down_proj)        (+ bias; post-expert norm if any)
    y_em (same rows, same order)

Two kinds of experts modules run (recognised by :mod:`epmoe.integrations.experts`): transformers v5
packed experts, whose own ``_apply_gate`` / ``act_fn`` run as written (so interleaved gate/up such
as GPT-OSS works; on an NPU the default SiLU gate runs as ``torch_npu.npu_swiglu``), and
``nn.ModuleList`` experts: Linear triples have their weights stacked and run grouped, any other
expert module is called on its own rows (idle experts on zero rows).

:func:`experts_backend` says which grouped-matmul backend that runs on, judged on every grouped
matmul :func:`experts_forward` issues (:func:`gmm_probes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from epmoe import errors, platform
from epmoe.gmm import BackendStatus, GmmBackend, choose_backend, gmm_backends_for, grouped_mm
from epmoe.integrations.experts import is_default_silu_gate, is_packed_experts, linear_triples

__all__ = [
    "experts_backend",
    "experts_forward",
    "experts_gmm_backends",
    "gate_activation",
    "gmm_probes",
    "is_packed_experts",
    "num_experts_of",
    "packed_weight_names",
    "runs_grouped",
]

def num_experts_of(module: nn.Module) -> int:
    """Number of experts a packed or ``nn.ModuleList`` experts module holds now."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    return module.down_proj.shape[0]


def gmm_probes(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every ``grouped_mm`` call :func:`experts_forward` issues on ``module``, by projection name, as
    ``(x, weight, trans_weight)`` with the real shapes, layouts, dtype and device.

    ``x`` is an empty ``(0, K)`` tensor like the real (contiguous) input; ``weight`` is the packed
    parameter itself, or, for an ``nn.ModuleList`` of Linear triples, an uninitialised tensor laid out
    like the stacked weight :func:`experts_forward` builds. A ``ModuleList`` run expert by expert
    issues no grouped matmul: ``{}``.
    """
    if isinstance(module, nn.ModuleList):
        triples = linear_triples(module)
        if triples is None:
            return {}
        gate, up, down = triples[0]
        e = len(triples)
        weights = {  # nn.Linear layout (e, out, in), contiguous like torch.stack / torch.cat output
            "gate_up_proj": gate.weight.new_empty(e, gate.out_features + up.out_features, gate.in_features),
            "down_proj": down.weight.new_empty(e, down.out_features, down.in_features),
        }
        trans_weight = True
    else:
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        weights = {up_name: getattr(module, up_name), "down_proj": module.down_proj}
        trans_weight = not module.is_transposed
    k_dim = 2 if trans_weight else 1
    return {name: (w.new_empty(0, w.shape[k_dim]), w, trans_weight) for name, w in weights.items()}


def experts_gmm_backends(module: nn.Module) -> list[BackendStatus]:
    """Every registered grouped-matmul backend with whether :func:`experts_forward` could run
    ``module`` on it: eligible only if it accepts every call of :func:`gmm_probes`.

    A ``ModuleList`` run expert by expert calls each expert's own forward, which is the ``loop``
    backend's per-group matmuls: only ``loop`` is eligible.
    """
    probes = gmm_probes(module)
    if probes:
        return gmm_backends_for(probes)
    why = "the experts are not bias-free nn.Linear triples with an act_fn: each runs its own forward"
    return [BackendStatus(s.name, s.name == "loop", None if s.name == "loop" else why) for s in gmm_backends_for({})]


def experts_backend(module: nn.Module, backend: str = "auto") -> GmmBackend:
    """The grouped-matmul backend :func:`experts_forward` runs ``module`` on (raises if a named one
    declines any of its calls). With ``"auto"``, an undifferentiated call (inference) on many small,
    even groups may take ``batched`` instead, chosen per call from its counts (:mod:`epmoe.gmm.batched`)."""
    return choose_backend(experts_gmm_backends(module), backend=backend)


def experts_forward(
    module: nn.Module, x_em: torch.Tensor, counts: Sequence[int] | torch.Tensor, *, backend: str = "auto",
    sync_weights: WeightsHook | None = None,
) -> torch.Tensor:
    """Run ``module``'s (local) experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``.

    ``x_em``: ``(A, H)``, rows expert-major. ``counts``: ints, or a 1-D integer tensor, which the
    grouped matmuls read where they run (so a caller whose counts are on the device keeps them there:
    ``torch.compile`` traces it; see :func:`runs_grouped`). Returns ``(A, H)`` in the same order.
    ``sync_weights`` (the EP engine's gradient policy, :mod:`epmoe.training.grads`) receives the
    weight tensors the grouped matmuls are about to use and returns those to use instead (same
    values); experts run by their own forward hand it their parameters with ``per_parameter=True``
    (nothing to substitute).
    """
    if isinstance(counts, torch.Tensor):
        errors.check_counts_tensor("experts_forward(counts)", counts)
    else:
        counts = errors.int_list("experts_forward(counts)", counts)
    if len(counts) != num_experts_of(module):
        raise ValueError(f"experts_forward(counts): {len(counts)} counts for {num_experts_of(module)} experts")
    sync_weights = sync_weights or _as_is
    if isinstance(module, nn.ModuleList):
        return _module_list_forward(module, x_em, counts, backend, sync_weights)
    return _packed_forward(module, x_em, counts, backend, sync_weights)


def runs_grouped(module: nn.Module) -> bool:
    """Whether :func:`experts_forward` runs ``module`` through grouped matmuls only (packed experts,
    or a ``ModuleList`` of bias-free Linear triples), which read the counts inside the op; a
    ``ModuleList`` run expert by expert slices its rows by counts read to the host."""
    return not isinstance(module, nn.ModuleList) or linear_triples(module) is not None


class WeightsHook(Protocol):
    def __call__(self, weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]: ...


def _as_is(weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
    return weights


def _row_bias(bias_EN: torch.Tensor, counts: list[int] | torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(A, N)``: each row's expert bias (an index gather; its backward is index_put). Built where
    the counts are (host counts: on the host, then copied)."""
    counts_E = torch.as_tensor(counts)
    experts = torch.arange(len(counts), device=counts_E.device)
    expert_of_row = torch.repeat_interleave(experts, counts_E, output_size=num_rows)
    return bias_EN[platform.host_to_device(expert_of_row, bias_EN.device)]


def gate_activation(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The packed experts' gate (``_apply_gate``) or activation (``act_fn``) on ``h``; ``npu_swiglu`` on an NPU."""
    if not module.has_gate:
        return module.act_fn(h)
    if platform.device_type(h) == "npu" and is_default_silu_gate(module):
        return platform.torch_npu().npu_swiglu(h, dim=-1)
    return module._apply_gate(h)


def packed_weight_names(module: nn.Module) -> list[str]:
    """The per-expert tensors of a packed experts module: up (or gate_up), down, and their biases."""
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    names = [up_name, "down_proj"]
    return names + [f"{name}_bias" for name in names] if module.has_bias else names


def _packed_forward(
    module: nn.Module, x_em: torch.Tensor, counts: list[int] | torch.Tensor, backend: str, sync_weights: WeightsHook
) -> torch.Tensor:
    trans_weight = not module.is_transposed  # nn.Linear layout (E, out, in) is our "transposed"
    num_rows = x_em.shape[0]
    up, down, *biases = sync_weights([getattr(module, name) for name in packed_weight_names(module)])
    h = grouped_mm(x_em, up, counts, trans_weight=trans_weight, backend=backend)
    if module.has_bias:
        h = h + _row_bias(biases[0], counts, num_rows)
    h = gate_activation(module, h)
    y = grouped_mm(h, down, counts, trans_weight=trans_weight, backend=backend)
    if module.has_bias:
        y = y + _row_bias(biases[1], counts, num_rows)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y


def _module_list_forward(
    experts: nn.ModuleList, x_em: torch.Tensor, counts: list[int] | torch.Tensor, backend: str, sync_weights: WeightsHook
) -> torch.Tensor:
    triples = linear_triples(experts)
    if triples is not None:
        gate_w = torch.stack([t[0].weight for t in triples])  # (e, I, H), nn.Linear layout
        up_w = torch.stack([t[1].weight for t in triples])
        down_w = torch.stack([t[2].weight for t in triples])  # (e, H, I)
        gate_up_w, down_w = sync_weights([torch.cat([gate_w, up_w], dim=1), down_w])  # (e, 2I, H), (e, H, I)
        gate, up = grouped_mm(x_em, gate_up_w, counts, trans_weight=True, backend=backend).chunk(2, dim=-1)
        h = experts[0].act_fn(gate) * up
        return grouped_mm(h, down_w, counts, trans_weight=True, backend=backend)
    sync_weights(list(experts.parameters()), per_parameter=True)
    if isinstance(counts, torch.Tensor):
        counts = errors.int_list("experts_forward(counts)", counts)
    outputs, start = [], 0
    for expert, n in zip(experts, counts):
        # Idle experts run too, on zero rows: autograd then gives their parameters exact-zero
        # gradients (as the grouped paths do), not None; it also keeps the output connected to x_em,
        # whose exchange must run in backward on every rank.
        outputs.append(expert(x_em[start:start + n]))
        start += n
    return torch.cat(outputs)
