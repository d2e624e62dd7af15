"""Grouped experts compute: the local experts' MLP, and the grouped-matmul backend it runs on.

An EP layer calls :meth:`LocalExperts.routed_mlp` on the rows its rank holds and the pairs they
expand to (:mod:`epmoe.ep.routing`): ``epmoe::routed_mlp`` (:mod:`epmoe.ep.mlp`), which gathers,
weights and sums by index and keeps little for backward, for packed experts without a post-expert
norm and Linear triples, holding no parameter shared by the experts; the others go through
plain autograd (:mod:`epmoe.ep.experts_autograd`, the base of :class:`LocalExperts`, whose
``forward``, and :func:`experts_forward`, run the MLP on rows already sorted by local expert). Both
run :func:`epmoe.ep.mlp.expert_mlp`, the one place the MLP is written::

    x_em (rows expert-major, counts[j] rows for local expert j)
      -> gate_up projection   grouped_mm(x_em, gate_up_proj)  (+ bias of each row's expert)
      -> gate / activation    module._apply_gate (SwiGLU, GPT-OSS clamped SwiGLU, ...) or act_fn
      -> down projection      grouped_mm(h, down_proj)        (+ bias; post-expert norm if any)
    y_em (same rows, same order)

The weights come from :class:`~epmoe.ep.expert_weights.ExpertWeights` (:attr:`LocalExperts.weights`:
packed or ``nn.ModuleList``, Linear triples, shared parameters, compute dtype). Packed experts' own
``_apply_gate`` / ``act_fn`` run as written (so interleaved gate/up such as GPT-OSS works; on an NPU
the default SiLU gate runs as ``torch_npu.npu_swiglu``); Linear triples run grouped; any other expert
module is called on its own rows (idle experts on zero rows). Over more than one rank, experts holding
parameters shared by every expert run once per source rank (:mod:`epmoe.ep.experts_autograd`). PEFT
wrappers around the experts: :mod:`epmoe.ep.expert_lora`.

:class:`LocalExperts` holds what is decided once per experts module about its compute, when EP is
applied: its weights, whether its gate is transformers' default, its per-expert post module, and its
grouped-matmul backend (:meth:`LocalExperts.gmm_backend`): an :class:`~epmoe.gmm.BackendChoice` that
every backend judges on all the grouped matmuls the module issues
(:func:`~epmoe.ep.expert_weights.gmm_probes`) once per device and dtype, judged again only for operands
that differ from those (:class:`~epmoe.gmm.registry.Operands`). Every grouped matmul of a forward and
its backward (the routed MLP op's, the plain path's, the fused ops') runs that one backend, asked for
where the matmuls run, so nothing of the choice is traced by ``torch.compile``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from epmoe import platform
from epmoe.ep.expert_weights import ExpertWeights, WeightsHook, as_is, gmm_probes
from epmoe.ep.experts_autograd import AutogradPaths
from epmoe.ep.mlp import register_experts, routed_mlp_autograd, routed_mlp_custom_op
from epmoe.ep.recognize import is_default_silu_gate, is_silu, num_experts_of
from epmoe.ep.replicas import min_rows
from epmoe.ep.routing import RowPairs, RowSources
from epmoe.gmm import BackendChoice, BackendStatus, GmmBackend, choose_backend, gmm_backends_for


class Replicas(NamedTuple):
    """The experts other ranks lend a layer call (:mod:`epmoe.ep.replicas`), from the layer's lending
    step (:func:`epmoe.comm.replicas.lend_expert_weights`), each list ``[up, down, up_bias, down_bias]``
    as the forward uses them (:meth:`~epmoe.ep.expert_weights.ExpertWeights.read`): ``weights``, the
    local experts' own, through the exchange (its backward adds the copies' gradients into theirs);
    ``copies``, the lent experts', ``(n, ...)`` each, in the order of the helper's replicas
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.received`); ``pairs``, the pairs of the rows they run."""

    weights: list[torch.Tensor | None]
    copies: list[torch.Tensor | None]
    pairs: RowPairs


def experts_gmm_backends(module: nn.Module) -> list[BackendStatus]:
    """Every registered grouped-matmul backend with whether :func:`experts_forward` could run
    ``module`` on it: eligible only if it accepts every call of :func:`~epmoe.ep.expert_weights.gmm_probes`.

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
    module: nn.Module,
    x_em: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    *,
    backend: str = "auto",
    sync_weights: WeightsHook | None = None,
) -> torch.Tensor:
    """Run ``module``'s (local) experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``
    (:meth:`LocalExperts.forward` of a :class:`LocalExperts` made for this one call)."""
    return LocalExperts(module, backend).forward(x_em, counts, sync_weights=sync_weights)


class LocalExperts(AutogradPaths):
    """One experts module's local experts and how they run, decided once (see the module docstring).

    ``module``: packed experts, or an ``nn.ModuleList`` of experts; ``backend``: ``"auto"`` or a
    registered grouped-matmul backend name (``ExpertParallelConfig.gmm_backend``); ``shared``: the
    parameters the experts share (default: :func:`~epmoe.ep.recognize.shared_parameters` of
    ``module``; a sharded ``ModuleList``'s, found on all its experts before sharding); ``post``: the
    name of a per-expert post module to run on each route's output
    (:func:`~epmoe.ep.recognize.per_expert_post`: EP runs the module's whole forward, of which it is
    part; as ``experts_implementation="epmoe"`` the module's own forward runs it).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: str = "auto",
        shared: Sequence[nn.Parameter] | None = None,
        post: str | None = None,
    ):
        self.module = module
        self.post = post
        self.weights = ExpertWeights(module, shared)  # what the experts hold and how their weights are read
        self.default_gate = self.weights.packed and is_default_silu_gate(module)
        self.gmm = BackendChoice(backend, self._gmm_family)  # the grouped matmuls' backend, chosen once
        self.key = register_experts(self)  # how epmoe::routed_mlp finds this object's gate and backend

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of the model) registers itself: the op must find the copy's gate
        and backend choice, not the original's, which may be gone."""
        self.__dict__.update(state)
        self.key = register_experts(self)

    def _gmm_family(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
        return gmm_probes(self.module)

    def gmm_backend(
        self,
        up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
        *,
        counts: list[int] | None = None,
        backward: bool = True,
    ) -> GmmBackend:
        """The backend every grouped matmul of this module's MLP runs on (both projections, forward
        and backward; :attr:`~epmoe.ep.expert_weights.ExpertWeights.grouped` experts only), for weights
        ``up`` / ``down`` as a forward uses them (default: the module's own) on rows like the ones the
        ops gather (contiguous, fresh).

        Chosen once per device and dtype by :attr:`gmm` (an :class:`~epmoe.gmm.BackendChoice` over
        :func:`~epmoe.ep.expert_weights.gmm_probes`): every registered backend judges both projections
        together the first time, and later calls only compare operands
        (:class:`~epmoe.gmm.registry.Operands`): weights with other strides or alignment than the
        module's (a substitute from the gradient policy, a PEFT wrapper) are judged again, once per
        such operands. ``counts`` (host counts) and
        ``backward`` (whether the call is differentiated) let ``auto`` take a backend that wins only
        on some group sizes for this call. Called where the grouped matmuls run (inside the ops,
        never while ``torch.compile`` traces): given ``up`` / ``down``, a dictionary lookup after the
        first call (:meth:`~epmoe.gmm.BackendChoice.backend_for_weights`)."""
        if not self.weights.packed and self.weights.triples is None:
            raise ValueError("LocalExperts.gmm_backend: these experts run their own forwards, not grouped matmuls")
        if up is None:
            return self.gmm.backend_for(list(gmm_probes(self.module).values()), counts=counts, backward=backward)
        return self.gmm.backend_for_weights((up, down), self.weights.trans_weight, counts=counts, backward=backward)

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
        if not self.weights.packed:
            gate, up = h.chunk(2, dim=-1)
            return module[0].act_fn(gate) * up
        if not module.has_gate:
            return module.act_fn(h)
        return module._apply_gate(h)

    def gate_vjp(self, h: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """``(a, vjp)``: :meth:`gate_reference` on ``h`` recomputed, and ``vjp(da) -> dh``. A SiLU gate
        (``silu(gate) * up`` on ``h``'s two halves: transformers' default, SiLU Linear triples) has its
        derivative written out, into one ``dh`` buffer; any other gate goes through ``torch.func.vjp``."""
        if not (self.default_gate or (not self.weights.packed and is_silu(self.module[0].act_fn))):
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
        the down projection, or Linear triples, with no parameter shared by the experts), keeping what
        :mod:`epmoe.ep.mlp` says."""
        if self.weights.shared_names or self.post is not None:
            return False
        if self.weights.packed:
            return not getattr(self.module, "has_post_expert_norm", False)
        return self.weights.triples is not None

    def why_not_lean(self) -> str | None:
        """Why these experts are not :attr:`lean`, or ``None`` where they are."""
        if self.lean:
            return None
        if self.weights.shared_names:
            return f"its experts share parameters ({', '.join(self.weights.shared_names)})"
        if self.post is not None:
            return f"a per-expert module ({self.post}) runs after the down projection"
        if self.weights.packed:
            return "a norm runs after the down projection"
        return "its experts run their own forwards (not bias-free Linear triples)"

    def routed_mlp(
        self,
        x_RH: torch.Tensor,
        weights_RK: torch.Tensor,
        pairs: RowPairs,
        *,
        sync_weights: WeightsHook | None = None,
        sources: RowSources | None = None,
        replicas: Replicas | None = None,
    ) -> torch.Tensor:
        """``(R, H)``: rows ``x_RH`` through the local experts their ``pairs`` name, weighted by
        ``weights_RK`` and summed per row (:mod:`epmoe.ep.mlp`): through the ``epmoe::routed_mlp``
        custom op (:func:`~epmoe.ep.mlp.routed_mlp_custom_op`), or, for experts that are not
        :attr:`lean`, through plain autograd (:func:`~epmoe.ep.mlp.routed_mlp_autograd`).

        The MLP runs in :meth:`~epmoe.ep.expert_weights.ExpertWeights.compute_dtype` (the rows are cast
        on arrival, the result stays in it: the combine sums it per token before the layer casts back).
        ``sources``: which ranks the rows came from (the all-to-all-v transport's, over more than one
        rank); the parameters shared by the experts then get, on each rank, the gradient of its own
        rows (:meth:`_by_source`). ``replicas`` (:attr:`lean` experts only): the local experts' weights
        as the layer read and lent them, and the experts other ranks lend this call, run by a second op
        on the same rows and added (:class:`Replicas`)."""
        sync_weights = sync_weights or as_is
        if not self.lean:
            if self.weights.packed:
                x_RH = x_RH.to(self.weights.compute_dtype(self.weights.weight_dtype()))
            forward = functools.partial(self.forward, sync_weights=sync_weights)
            if sources is not None and self._split_shared():
                forward = functools.partial(
                    self._by_source, pairs=pairs, K=weights_RK.shape[1], sources=sources, sync_weights=sync_weights
                )
            return routed_mlp_autograd(forward, x_RH, weights_RK, pairs)
        weights = self.weights.read(sync_weights) if replicas is None else replicas.weights  # in the compute dtype
        x_RH = x_RH.to(weights[0].dtype) if self.weights.packed else x_RH
        out_RH = routed_mlp_custom_op(
            self.key, x_RH, weights_RK, pairs, *weights, trans_weight=self.weights.trans_weight
        )
        if replicas is not None and replicas.pairs.counts_e.numel():  # some experts lent to this rank
            lent_RH = routed_mlp_custom_op(
                self.key, x_RH, weights_RK, replicas.pairs, *replicas.copies, trans_weight=self.weights.trans_weight
            )
            out_RH = out_RH + lent_RH
        return out_RH

    def replica_min_rows(self, hidden: int, flops_per_byte: float) -> float:
        """The fewest slots worth moving one of these experts to another rank over a link where a byte
        costs ``flops_per_byte`` (:func:`epmoe.ep.replicas.min_rows`; :mod:`epmoe.ep.links`), a
        training step's where :meth:`weights_trained`."""
        params = self.weights.expert_parameters()
        elements = sum(p.numel() for p in params) // num_experts_of(self.module)
        return min_rows(elements, hidden, params[0].element_size(), flops_per_byte, self.weights_trained())

    def weights_trained(self) -> bool:
        """Whether gradients will flow to these experts' weights: the module in training mode, with a
        per-expert parameter that requires grad or weights a parametrization makes from others (peft's
        LoRA on them). Not grad mode: under reentrant gradient checkpointing the forward runs without
        gradients and its recompute with them, and both must make the same replica plan."""
        if not self.module.training:
            return False
        return parametrize.is_parametrized(self.module) or any(
            p.requires_grad for p in self.weights.expert_parameters()
        )
