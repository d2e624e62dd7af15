"""The local experts' weights and layout: what an experts module holds and how its weights are read.

Two kinds of experts modules run (recognised by :mod:`epmoe.ep.recognize`): transformers v5 packed
experts, one tensor per projection holding every local expert (``(e, ...)``; read as packed views
where they are stacked rows or sit beside zero-computation experts:
:func:`~epmoe.ep.recognize.as_packed`), and ``nn.ModuleList`` experts, whose Linear triples have their
weights stacked and run grouped (any other expert module is called on its own rows; its parameters are
all :class:`ExpertWeights` reads). :class:`ExpertWeights` holds what is decided once per experts
module, when EP is applied: which kind it is, how its weights are laid out for the grouped matmuls
(:attr:`~ExpertWeights.trans_weight`), its Linear triples, the parameters its experts share, and its
compute dtype; :meth:`ExpertWeights.read` gives ``(up, down, up_bias, down_bias)`` as a forward uses
them, through the engine's gradient policy (a :class:`WeightsHook`).

Two things an experts module may hold besides its experts' weights are honoured:

* parameters shared by every expert (:func:`~epmoe.ep.recognize.shared_parameters`: a post-expert
  norm's weight, a learned activation scale): whole on every rank, not expert parameters
  (:attr:`ExpertWeights.shared_names`; :mod:`epmoe.ep.experts` gives each rank the gradient of its
  own rows);
* a compute dtype wider than the weights' (:func:`family_compute_dtype`: what the family's own
  forward runs its matmuls and sums in, float32 for OpenAI's privacy filter or Inkling2 in
  bfloat16): packed experts then run their MLP in it (:meth:`ExpertWeights.compute_dtype`), their
  output stays in it until the layer has summed each token's rows.

:func:`gmm_probes` lists the grouped matmuls a module's weights make (what the grouped-matmul backend
is judged on, :mod:`epmoe.ep.experts`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from epmoe.ep.expert_lora import expert_layers, rewrapped
from epmoe.ep.recognize import (
    as_packed,
    is_packed_experts,
    linear_triples,
    packed_names,
    packed_tensors,
    shared_parameters,
    stacked_rows,
    weights_transposed,
    zero_experts,
)

logger = logging.getLogger(__name__)


class WeightsHook(Protocol):
    def __call__(self, weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]: ...


def as_is(weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
    """The :class:`WeightsHook` that uses the weights as they are."""
    return weights


class ExpertWeights:
    """One experts module's local experts' weights and layout, decided once (see the module docstring).

    ``module``: packed experts, or an ``nn.ModuleList`` of experts; ``shared``: the parameters the
    experts share (default: :func:`~epmoe.ep.recognize.shared_parameters` of ``module``; a sharded
    ``ModuleList``'s, found on all its experts before sharding).
    """

    def __init__(self, module: nn.Module, shared: Sequence[nn.Parameter] | None = None):
        self.module = module
        self.packed = not isinstance(module, nn.ModuleList)
        ids = {id(p) for p in ([p for _, p in shared_parameters(module)] if shared is None else shared)}
        self.shared_names = tuple(n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids)
        self._compute_dtypes: dict[torch.dtype, torch.dtype] = {}  # parameter dtype -> the MLP's (compute_dtype)
        self.trans_weight = not weights_transposed(module) if self.packed else True  # nn.Linear layout: "transposed"
        self._triples = None if self.packed else linear_triples(module)
        self._weight_names = packed_weight_names(module) if self.packed else None
        # weights read as packed views: stacked rows, the experts with weights beside zero-computation ones
        self._views = self.packed and (stacked_rows(module) is not None or zero_experts(module) > 0)
        self._layers = [] if self.packed else expert_layers(module)
        if self.packed:
            self.compute_dtype(self.weight_dtype())  # found now, so that a compiled forward has it

    @property
    def triples(self) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]] | None:
        """A ``ModuleList``'s ``(gate, up, down)`` Linears if they run grouped (recognised once, and
        again only if an expert's layers were replaced since, e.g. wrapped by PEFT:
        :func:`~epmoe.ep.expert_lora.rewrapped`), else ``None``."""
        if not self.packed and rewrapped(self.module, self._layers):
            self._triples, self._layers = linear_triples(self.module), expert_layers(self.module)
        return self._triples

    @property
    def grouped(self) -> bool:
        """Whether the experts run through grouped matmuls only (packed experts, or Linear triples),
        which read the counts inside the op; experts run by their own forward slice their rows by
        counts read to the host."""
        return self.packed or self.triples is not None

    def read(
        self, sync_weights: WeightsHook | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(up, down, up_bias, down_bias)`` as a forward of :attr:`grouped` experts uses them
        (through ``sync_weights``), read with :attr:`trans_weight`, in the compute dtype: packed experts'
        own tensors (biases ``None`` without ``has_bias``; read as packed views:
        :func:`~epmoe.ep.recognize.as_packed`), or a ``ModuleList``'s Linear triples stacked."""
        sync_weights = sync_weights or as_is
        if not self.packed:
            up, down = sync_weights(self._stacked_triples())
            return up, down, None, None
        up, down, *biases = sync_weights([getattr(self.module, name) for name in self._weight_names])
        if self._views:  # the synced parameters as packed views
            up, down, *biases = as_packed(self.module, [up, down, *biases])
        dtype = self._compute_dtypes.get(up.dtype) or self.compute_dtype(up.dtype)  # a step: known
        up, down, *biases = (w.to(dtype) for w in (up, down, *biases))
        up_bias, down_bias = biases if biases else (None, None)
        return up, down, up_bias, down_bias

    def _stacked_triples(self) -> list[torch.Tensor]:
        """A ``ModuleList``'s Linear triples as ``[gate_up (e, 2I, H), down (e, H, I)]`` (nn.Linear layout)."""
        triples = self.triples
        gate_w = torch.stack([t[0].weight for t in triples])
        up_w = torch.stack([t[1].weight for t in triples])
        down_w = torch.stack([t[2].weight for t in triples])
        return [torch.cat([gate_w, up_w], dim=1), down_w]

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters of the local experts that are per expert (what EP shards: not
        :attr:`shared_names`), in ``module.parameters()`` order."""
        shared = set(self.shared_names)
        return [p for n, p in self.module.named_parameters() if n not in shared]

    def weight_dtype(self) -> torch.dtype:
        """The dtype of packed experts' up (or gate_up) projection."""
        return getattr(self.module, self._weight_names[0]).dtype

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the experts' MLP runs in when their weights are ``dtype``: the widest dtype the
        family's own experts forward computes in (its matmuls, the sum of the weighted expert outputs:
        :func:`family_compute_dtype`) where that is wider than ``dtype``, else ``dtype``. Found once per
        ``dtype`` (``nn.ModuleList`` experts: ``dtype``; their own forwards run, or Linear triples)."""
        known = self._compute_dtypes.get(dtype)
        if known is not None or not self.packed or torch.compiler.is_compiling():
            return known or dtype  # a compiled forward uses what an eager one (or EP's apply) found
        family = family_compute_dtype(self.module)
        if family is None:  # meta weights: the weights' dtype, asked again at the next forward
            return dtype
        self._compute_dtypes[dtype] = torch.promote_types(family, dtype)
        return self._compute_dtypes[dtype]


def packed_weight_names(module: nn.Module) -> list[str]:
    """The per-expert tensors of a packed experts module: up (or gate_up), down, and their biases;
    stacked-rows experts: their gate, up and down (:func:`~epmoe.ep.recognize.packed_names`)."""
    return packed_names(module)


def gmm_probes(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """Every ``grouped_mm`` call :func:`~epmoe.ep.experts.experts_forward` issues on ``module``, by
    projection name, as ``(x, weight, trans_weight)`` with the real shapes, layouts, dtype and device.

    ``x`` is an empty ``(0, K)`` tensor like the real (contiguous) input; ``weight`` is the packed
    parameter itself, or, for an ``nn.ModuleList`` of Linear triples, an uninitialised tensor laid out
    like the stacked weight :meth:`ExpertWeights.read` builds. A ``ModuleList`` run expert by expert
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
        weights = dict(zip((up_name, "down_proj"), packed_tensors(module)))
        trans_weight = not weights_transposed(module)
    return projection_calls(weights, trans_weight)


def projection_calls(
    weights: dict[str, torch.Tensor], trans_weight: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """The grouped matmuls on ``weights`` (by projection name) as ``(x, weight, trans_weight)``, ``x``
    an empty ``(0, K)`` tensor like the rows each one multiplies (contiguous, freshly allocated)."""
    k_dim = 2 if trans_weight else 1
    return {name: (w.new_empty(0, w.shape[k_dim]), w, trans_weight) for name, w in weights.items()}


_MATMULS = {
    torch.ops.aten.mm,
    torch.ops.aten.addmm,
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten.matmul,
    torch.ops.aten.linear,
    torch.ops.aten.mv,
    torch.ops.aten.addmv,
}


class _DtypeRecorder(TorchDispatchMode):
    """The dtypes a forward's matmuls produce, and the casts it makes (``(result, source dtype)``)."""

    def __init__(self):
        super().__init__()
        self.matmuls: list[torch.dtype] = []
        self.casts: list[tuple[torch.Tensor, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _MATMULS:
            self.matmuls.append(out.dtype)
        elif func.overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor):
            self.casts.append((out, args[0].dtype))
        return out


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> {weight dtype: dtype}


def family_compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The widest dtype a packed experts module's own forward (the family's code, under
    ``@use_experts_implementation``) computes in with its present weights: that of its matmuls and of
    the sum of the weighted expert outputs (what it returns, before a last cast back), found by
    running it once on two probe tokens routed to expert 0 (and to expert 1 with weight 0: some
    forwards need two choices) with float32 routing weights (what the routers of such families
    give). OpenAI's privacy filter (matmuls in float32) and Inkling2 (sums in float32) give float32 in
    a bfloat16 model; most families their weights' dtype. ``None`` where it cannot run yet (meta
    weights, or a partition of them such as ZeRO-3's outside a forward); where it fails, its weights'
    dtype (a WARNING says why). Kept per module and weight dtype: :func:`epmoe.apply_expert_parallel` asks
    before sharding (a family's forward may expect all its experts)."""
    if not is_packed_experts(module):
        raise TypeError(f"family_compute_dtype(module): expected packed experts, got {type(module).__name__}")
    up = packed_tensors(module)[0]
    found = _FOUND.setdefault(module, {})
    if up.dtype not in found and not up.is_meta and up.dim() == 3:
        found[up.dtype] = _probe_compute_dtype(module, up)
    return found.get(up.dtype)


def _probe_compute_dtype(module: nn.Module, up: torch.Tensor) -> torch.dtype:
    """:func:`family_compute_dtype`, found by running the family's forward once."""
    hidden = up.shape[1] if weights_transposed(module) else up.shape[2]
    x = torch.linspace(-1.0, 1.0, 2 * hidden, device=up.device).view(2, hidden).to(up.dtype)
    index = torch.tensor([[0, 1 % up.shape[0]]] * 2, dtype=torch.long, device=up.device)
    weights = torch.tensor([[0.5, 0.0]] * 2, dtype=torch.float32, device=up.device)
    forward = getattr(type(module).forward, "__wrapped__", type(module).forward)  # the family's own, undecorated
    try:
        inspect.signature(forward).bind(module, x, index, weights)
    except TypeError:  # not the experts contract (Llama4's input-weighted experts): its weights' dtype
        return up.dtype
    recorder = _DtypeRecorder()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[up.device] if up.device.type == "cuda" else []):
            with recorder:
                out = forward(module, x, index, weights)
    except Exception as exc:  # noqa: BLE001 - any failure of the family's own forward: computed as its weights
        logger.warning(
            "epmoe: %s's own forward failed on a probe (%s: %s): its experts compute in %s",
            type(module).__name__,
            type(exc).__name__,
            exc,
            up.dtype,
        )
        return up.dtype
    if not isinstance(out, torch.Tensor):  # not the experts contract's single tensor: its matmuls alone
        return functools.reduce(torch.promote_types, recorder.matmuls, up.dtype)
    summed = next((source for result, source in recorder.casts if result is out), out.dtype)
    return functools.reduce(torch.promote_types, recorder.matmuls, summed)
