"""Grouped experts compute: the local experts' MLP.

An EP layer calls :meth:`LocalExperts.routed_mlp` on the rows its rank holds and the pairs they
expand to (:mod:`epmoe.ep.routing`): ``epmoe::routed_mlp`` (:mod:`epmoe.ep.mlp`), which gathers,
weights and sums by index and keeps little for backward, for packed experts without a post-expert
norm and Linear triples; the others go through :meth:`LocalExperts.forward` and plain autograd.
:meth:`LocalExperts.forward` (and :func:`experts_forward`) run the MLP on rows already sorted by
local expert; both run :func:`epmoe.ep.mlp.expert_mlp`, the one place the MLP is written::

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
transformers' default, and its grouped-matmul backend (:meth:`LocalExperts.gmm_backend`): an
:class:`~epmoe.gmm.BackendChoice` that every backend judges on all the grouped matmuls the module
issues (:func:`gmm_probes`) once per device and dtype, judged again only for operands that differ
from those (:class:`~epmoe.gmm.registry.Operands`). Every grouped matmul of a forward and its
backward (the routed MLP op's, the plain path's, the fused ops') runs that one backend, asked for
where the matmuls run, so nothing of the choice is traced by ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from epmoe import errors, platform
from epmoe.ep.mlp import expert_mlp, register_experts, routed_mlp_autograd, routed_mlp_custom_op
from epmoe.ep.recognize import is_default_silu_gate, is_silu, linear_triples, num_experts_of
from epmoe.ep.routing import RowPairs
from epmoe.gmm import BackendChoice, BackendStatus, GmmBackend, choose_backend, gmm_backends_for, grouped_mm
from epmoe.gmm.backend import prefix


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
    return projection_calls(weights, trans_weight)


def projection_calls(weights: dict[str, torch.Tensor], trans_weight: bool
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """The grouped matmuls on ``weights`` (by projection name) as ``(x, weight, trans_weight)``, ``x``
    an empty ``(0, K)`` tensor like the rows each one multiplies (contiguous, freshly allocated)."""
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
        self.module = module
        self.packed = not isinstance(module, nn.ModuleList)
        self.default_gate = self.packed and is_default_silu_gate(module)
        self.trans_weight = not module.is_transposed if self.packed else True  # nn.Linear layout: "transposed"
        self._triples = None if self.packed else linear_triples(module)
        self._weight_names = packed_weight_names(module) if self.packed else None
        self._children = self._layers()
        self.gmm = BackendChoice(backend, self._gmm_family)  # the grouped matmuls' backend, chosen once
        self.key = register_experts(self)  # how epmoe::routed_mlp finds this object's gate and backend

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of the model) registers itself: the op must find the copy's gate
        and backend choice, not the original's, which may be gone."""
        self.__dict__.update(state)
        self.key = register_experts(self)

    def _gmm_family(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
        return gmm_probes(self.module)

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

    def gmm_backend(self, up: torch.Tensor | None = None, down: torch.Tensor | None = None, *,
                    counts: list[int] | None = None, backward: bool = True) -> GmmBackend:
        """The backend every grouped matmul of this module's MLP runs on (both projections, forward
        and backward; :attr:`grouped` experts only), for weights ``up`` / ``down`` as a forward uses
        them (default: the module's own) on rows like the ones the ops gather (contiguous, fresh).

        Chosen once per device and dtype by :attr:`gmm` (an :class:`~epmoe.gmm.BackendChoice` over
        :func:`gmm_probes`): every registered backend judges both projections together the first
        time, and later calls only compare operands (:class:`~epmoe.gmm.registry.Operands`): weights
        with other strides or alignment than the module's (a substitute from the gradient policy, a
        PEFT wrapper) are judged again, once per such operands. ``counts`` (host counts) and
        ``backward`` (whether the call is differentiated) let ``auto`` take a backend that wins only
        on some group sizes for this call. Called where the grouped matmuls run (inside the ops,
        never while ``torch.compile`` traces): given ``up`` / ``down``, a dictionary lookup after the
        first call (:meth:`~epmoe.gmm.BackendChoice.backend_for_weights`)."""
        if not self.packed and self.triples is None:
            raise ValueError("LocalExperts.gmm_backend: these experts run their own forwards, not grouped matmuls")
        if up is None:
            return self.gmm.backend_for(list(gmm_probes(self.module).values()), counts=counts, backward=backward)
        return self.gmm.backend_for_weights((up, down), self.trans_weight, counts=counts, backward=backward)

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
        if self.default_gate and platform.device_type(h) == "npu":
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
        ``weights_RK`` and summed per row (:mod:`epmoe.ep.mlp`): through the ``epmoe::routed_mlp``
        custom op (:func:`~epmoe.ep.mlp.routed_mlp_custom_op`), or, for experts that are not
        :attr:`lean`, through plain autograd (:func:`~epmoe.ep.mlp.routed_mlp_autograd`)."""
        sync_weights = sync_weights or _as_is
        if not self.lean:
            return routed_mlp_autograd(
                lambda x_PH, counts: self.forward(x_PH, counts, sync_weights=sync_weights), x_RH, weights_RK, pairs)
        up, down, up_bias, down_bias = self.weights(sync_weights)
        return routed_mlp_custom_op(self.key, x_RH, weights_RK, pairs, up, down, up_bias, down_bias,
                                    trans_weight=self.trans_weight)

    def weights(self, sync_weights: WeightsHook | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(up, down, up_bias, down_bias)`` as a forward of :attr:`grouped` experts uses them
        (through ``sync_weights``), read with :attr:`trans_weight`: packed experts' own tensors
        (biases ``None`` without ``has_bias``), or a ``ModuleList``'s Linear triples stacked."""
        sync_weights = sync_weights or _as_is
        if not self.packed:
            up, down = sync_weights(self._stacked_triples())
            return up, down, None, None
        up, down, *biases = sync_weights([getattr(self.module, name) for name in self._weight_names])
        up_bias, down_bias = biases if biases else (None, None)
        return up, down, up_bias, down_bias

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
        _, y = self._grouped_mlp(x_em, counts, sync_weights)
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        return y

    def _grouped_mlp(self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~epmoe.ep.mlp.expert_mlp` through :func:`epmoe.grouped_mm` (plain autograd), on
        the backend :attr:`gmm` chose (asked inside the op: nothing of the choice is traced)."""
        up, down, up_bias, down_bias = self.weights(sync_weights)
        trans_weight, choice = self.trans_weight, self.gmm
        return expert_mlp(x_em, counts, up, down, up_bias, down_bias, self.gate_activation,
                          lambda x, w: grouped_mm(x, w, counts, trans_weight=trans_weight, backend=choice))

    def _module_list_forward(self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
                             ) -> torch.Tensor:
        experts = self.module
        if self.triples is not None:
            return self._grouped_mlp(x_em, counts, sync_weights)[1]
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


def packed_weight_names(module: nn.Module) -> list[str]:
    """The per-expert tensors of a packed experts module: up (or gate_up), down, and their biases."""
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    names = [up_name, "down_proj"]
    return names + [f"{name}_bias" for name in names] if module.has_bias else names
