"""Grouped experts compute: the local experts' MLP.

An EP layer calls :meth:`LocalExperts.routed_mlp` on the rows its rank holds and the pairs they
expand to (:mod:`epmoe.ep.routing`): ``epmoe::routed_mlp`` (:mod:`epmoe.ep.mlp`), which gathers,
weights and sums by index and keeps little for backward, for packed experts without a post-expert
norm and Linear triples; the others go through :meth:`LocalExperts.forward` and plain autograd.
:meth:`LocalExperts.forward` (and :func:`experts_forward`) run the MLP on rows already sorted by
local expert::

    x_em (rows expert-major, counts[j] rows for local expert j)
      -> gate_up projection   grouped_mm(x_em, gate_up_proj)  (+ bias of each row's expert)
      -> gate / activation    module._apply_gate (SwiGLU, GPT-OSS clamped SwiGLU, ...) or act_fn
      -> down projection      grouped_mm(h, down_proj)        (+ bias; post-expert norm if any)
    y_em (same rows, same order)

Two kinds of experts modules run (recognised by :mod:`epmoe.ep.recognize`): transformers v5
packed experts, whose own ``_apply_gate`` / ``act_fn`` run as written (so interleaved gate/up such
as GPT-OSS works; on an NPU the default SiLU gate runs as ``torch_npu.npu_swiglu``), and
``nn.ModuleList`` experts: Linear triples have their weights stacked and run grouped, any other
expert module is called on its own rows (idle experts on zero rows).

:class:`LocalExperts` holds what is decided once per experts module, when EP is applied: which kind
it is (packed, Linear triples run grouped, or experts run by their own forward), whether its gate is
transformers' default, and each backend's eligibility on every grouped matmul it issues
(:func:`gmm_probes`, judged again only when the weights change device or dtype). Each forward then
chooses its grouped-matmul backend once, for both projections, and its backward reuses that choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from epmoe import errors, platform
from epmoe.ep.mlp import register_experts, routed_mlp, routed_mlp_autograd
from epmoe.ep.recognize import is_default_silu_gate, is_silu, linear_triples, num_experts_of
from epmoe.ep.routing import RowPairs
from epmoe.gmm import BackendStatus, GmmBackend, choose_backend, gmm_backends_for, grouped_mm
from epmoe.gmm.backend import prefix
from epmoe.gmm.registry import PREFERRED


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
    """Run ``module``'s (local) experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``
    (:meth:`LocalExperts.forward` of a :class:`LocalExperts` made for this one call)."""
    return LocalExperts(module, backend).forward(x_em, counts, sync_weights=sync_weights)


class LocalExperts:
    """One experts module's local experts and how they run, decided once (see the module docstring).

    ``module``: packed experts, or an ``nn.ModuleList`` of experts; ``backend``: ``"auto"`` or a
    registered grouped-matmul backend name (``ExpertParallelConfig.gmm_backend``).
    """

    def __init__(self, module: nn.Module, backend: str = "auto"):
        self.module, self.backend = module, backend
        self.packed = not isinstance(module, nn.ModuleList)
        self.default_gate = self.packed and is_default_silu_gate(module)
        self._triples = None if self.packed else linear_triples(module)
        self._children = self._layers()
        self._statuses: dict[tuple[torch.device, torch.dtype], list[BackendStatus]] = {}
        self.key = register_experts(self)  # how epmoe::routed_mlp finds this object's gate

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of the model) registers itself: the op must find the copy's gate,
        not the original's, which may be gone."""
        self.__dict__.update(state)
        self.key = register_experts(self)

    def _layers(self) -> list[tuple[nn.Module, ...]]:
        return [] if self.packed else [tuple(expert.children()) for expert in self.module]

    @property
    def triples(self) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]] | None:
        """A ``ModuleList``'s ``(gate, up, down)`` Linears if they run grouped (recognised once, and
        again only if an expert's layers were replaced since, e.g. wrapped by PEFT), else ``None``."""
        if not self.packed and any(a is not b for old, new in zip(self._children, self._layers())
                                   for a, b in zip(old, new)):
            self._triples, self._children = linear_triples(self.module), self._layers()
        return self._triples

    @property
    def grouped(self) -> bool:
        """Whether :meth:`forward` runs through grouped matmuls only (packed experts, or Linear
        triples), which read the counts inside the op; experts run by their own forward slice their
        rows by counts read to the host."""
        return self.packed or self.triples is not None

    def gmm_statuses(self) -> list[BackendStatus]:
        """Every backend's eligibility for this module's grouped matmuls (:func:`experts_gmm_backends`),
        judged once per device and dtype of the weights."""
        weight = next(self.module.parameters())
        key = (weight.device, weight.dtype)
        statuses = self._statuses.get(key)
        if statuses is None:
            statuses = self._statuses[key] = experts_gmm_backends(self.module)
        return statuses

    def choose_backend(self, counts: list[int] | torch.Tensor, x_em: torch.Tensor) -> str:
        """The backend this forward's grouped matmuls (and their backward) run on: chosen once, from
        :meth:`gmm_statuses` and, for ``auto``, host counts (a backend that wins only on some group
        sizes is taken only where the counts are a host list: a counts tensor is never read here). Under
        ``torch.compile`` the configured name goes to the op, which chooses when it runs (nothing of the
        choice is traced)."""
        if torch.compiler.is_compiling():
            return self.backend
        if isinstance(counts, torch.Tensor):
            counts = None  # not read: the op reads it only for a backend that needs host counts
        differentiable = torch.is_grad_enabled() and (x_em.requires_grad or any(
            p.requires_grad for p in self.module.parameters()))
        chosen = choose_backend(self.gmm_statuses(), backend=self.backend, counts=counts, x=x_em,
                                backward=differentiable).name
        # a named backend is held to it; auto's choice was made on probes of these operands: if the
        # real ones differ where a backend looks (alignment), the op falls back as auto would
        return chosen if self.backend != "auto" else PREFERRED + chosen

    def forward(self, x_em: torch.Tensor, counts: Sequence[int] | torch.Tensor, *,
                sync_weights: WeightsHook | None = None) -> torch.Tensor:
        """The local experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``.

        ``x_em``: ``(A, H)``, rows expert-major. ``counts``: ints, or a 1-D integer tensor, which the
        grouped matmuls read where they run (so a caller whose counts are on the device keeps them
        there: ``torch.compile`` traces it; see :attr:`grouped`). Returns ``(A, H)`` in the same
        order. ``sync_weights`` (the engine's gradient policy, :mod:`epmoe.ep.grads`) receives the
        weight tensors the grouped matmuls are about to use and returns those to use instead (same
        values); experts run by their own forward hand it their parameters with ``per_parameter=True``
        (nothing to substitute).
        """
        if isinstance(counts, torch.Tensor):
            errors.check_counts_tensor("experts_forward(counts)", counts)
        else:
            counts = errors.int_list("experts_forward(counts)", counts)
        if len(counts) != num_experts_of(self.module):
            raise ValueError(f"experts_forward(counts): {len(counts)} counts for {num_experts_of(self.module)} experts")
        sync_weights = sync_weights or _as_is
        if self.packed:
            return self._packed_forward(x_em, counts, sync_weights)
        return self._module_list_forward(x_em, counts, sync_weights)

    def gate_activation(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' gate on the up projection's output ``h``: packed experts' ``_apply_gate`` or
        ``act_fn`` (``npu_swiglu`` on an NPU for transformers' default gate), Linear triples'
        ``act_fn(gate) * up``."""
        if self.packed and self.default_gate and platform.device_type(h) == "npu":
            return platform.torch_npu().npu_swiglu(h, dim=-1)
        return self.gate_reference(h)

    def gate_reference(self, h: torch.Tensor) -> torch.Tensor:
        """:meth:`gate_activation` in plain torch ops (what ``epmoe::routed_mlp`` differentiates)."""
        module = self.module
        if not self.packed:
            gate, up = h.chunk(2, dim=-1)
            return module[0].act_fn(gate) * up
        if not module.has_gate:
            return module.act_fn(h)
        return module._apply_gate(h)

    def gate_vjp(self, h: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """``(a, vjp)``: :meth:`gate_reference` on ``h`` recomputed, and ``vjp(da) -> dh``. A SiLU gate
        (``silu(gate) * up`` on ``h``'s two halves: transformers' default, SiLU Linear triples) has its
        derivative written out, into one ``dh`` buffer; any other gate goes through ``torch.func.vjp``."""
        if not (self.default_gate or (not self.packed and is_silu(self.module[0].act_fn))):
            a, vjp = torch.func.vjp(self.gate_reference, h)
            return a, lambda da: vjp(da)[0]
        gate, up = h.chunk(2, dim=-1)
        silu = F.silu(gate)

        def silu_gate_vjp(da: torch.Tensor) -> torch.Tensor:
            dh = torch.empty_like(h)
            d_gate, d_up = dh.chunk(2, dim=-1)
            torch.mul(da, silu, out=d_up)
            torch.mul(da, up, out=d_gate)
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)  # elementwise, in place
            return dh

        return silu * up, silu_gate_vjp

    @property
    def lean(self) -> bool:
        """Whether :meth:`routed_mlp` runs ``epmoe::routed_mlp`` (packed experts without a norm after
        the down projection, or Linear triples), keeping what :mod:`epmoe.ep.mlp` says."""
        if self.packed:
            return not getattr(self.module, "has_post_expert_norm", False)
        return self.triples is not None

    def routed_mlp(self, x_RH: torch.Tensor, weights_RK: torch.Tensor, pairs: RowPairs, *,
                   sync_weights: WeightsHook | None = None) -> torch.Tensor:
        """``(R, H)``: rows ``x_RH`` through the local experts their ``pairs`` name, weighted by
        ``weights_RK`` and summed per row (:mod:`epmoe.ep.mlp`)."""
        sync_weights = sync_weights or _as_is
        if not self.lean:
            return routed_mlp_autograd(
                lambda x_PH, counts: self.forward(x_PH, counts, sync_weights=sync_weights), x_RH, weights_RK, pairs)
        backend = self.choose_backend(pairs.counts, x_RH)
        if self.packed:
            module = self.module
            up, down, *biases = sync_weights([getattr(module, name) for name in packed_weight_names(module)])
            up_bias, down_bias = biases if biases else (None, None)
            trans_weight = not module.is_transposed
        else:
            up, down = sync_weights(self._stacked_triples())
            up_bias = down_bias = None
            trans_weight = True
        return routed_mlp(self.key, x_RH, weights_RK, pairs, up, down, up_bias, down_bias,
                          trans_weight=trans_weight, backend=backend)

    def _stacked_triples(self) -> list[torch.Tensor]:
        """A ``ModuleList``'s Linear triples as ``[gate_up (e, 2I, H), down (e, H, I)]`` (nn.Linear layout)."""
        triples = self.triples
        gate_w = torch.stack([t[0].weight for t in triples])
        up_w = torch.stack([t[1].weight for t in triples])
        down_w = torch.stack([t[2].weight for t in triples])
        return [torch.cat([gate_w, up_w], dim=1), down_w]

    def _packed_forward(self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
                        ) -> torch.Tensor:
        module = self.module
        trans_weight = not module.is_transposed  # nn.Linear layout (E, out, in) is our "transposed"
        num_rows = x_em.shape[0]
        backend = self.choose_backend(counts, x_em)
        up, down, *biases = sync_weights([getattr(module, name) for name in packed_weight_names(module)])
        h = grouped_mm(x_em, up, counts, trans_weight=trans_weight, backend=backend)
        if module.has_bias:
            h = h + _row_bias(biases[0], counts, num_rows)
        h = self.gate_activation(h)
        y = grouped_mm(h, down, counts, trans_weight=trans_weight, backend=backend)
        if module.has_bias:
            y = y + _row_bias(biases[1], counts, num_rows)
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        return y

    def _module_list_forward(self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
                             ) -> torch.Tensor:
        experts, triples = self.module, self.triples
        if triples is not None:
            backend = self.choose_backend(counts, x_em)
            gate_up_w, down_w = sync_weights(self._stacked_triples())  # (e, 2I, H), (e, H, I)
            h = self.gate_reference(grouped_mm(x_em, gate_up_w, counts, trans_weight=True, backend=backend))
            return grouped_mm(h, down_w, counts, trans_weight=True, backend=backend)
        sync_weights(list(experts.parameters()), per_parameter=True)
        if isinstance(counts, torch.Tensor):
            counts = errors.int_list("experts_forward(counts)", counts)
        # Idle experts run too, on zero rows: autograd then gives their parameters exact-zero
        # gradients (as the grouped paths do), not None; it also keeps the output connected to x_em,
        # whose exchange must run in backward on every rank.
        starts = prefix(counts)
        return torch.cat([expert(x_em[starts[j]:starts[j + 1]]) for j, expert in enumerate(experts)])


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


def packed_weight_names(module: nn.Module) -> list[str]:
    """The per-expert tensors of a packed experts module: up (or gate_up), down, and their biases."""
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    names = [up_name, "down_proj"]
    return names + [f"{name}_bias" for name in names] if module.has_bias else names
