"""The plain-autograd paths of the local experts: what :class:`~epmoe.ep.experts.LocalExperts` runs
where ``epmoe::routed_mlp`` does not (its :attr:`~epmoe.ep.experts.LocalExperts.lean` is false), and
:meth:`~AutogradPaths.forward`, the MLP on rows already sorted by local expert (:func:`epmoe.ep.experts.experts_forward`).

:class:`AutogradPaths` is the base of :class:`~epmoe.ep.experts.LocalExperts`, which provides what
these paths read: ``module`` (the experts module), ``weights`` (its
:class:`~epmoe.ep.expert_weights.ExpertWeights`), ``post`` (a per-expert post module's name, or
``None``), ``gmm`` (the grouped-matmul backend choice) and ``gate_activation``. The paths:

* packed experts (:meth:`AutogradPaths._packed_forward`): the grouped MLP (:func:`epmoe.ep.mlp.expert_mlp`
  on :func:`epmoe.grouped_mm`), then a post-expert norm or a per-expert post module (its weights
  synced with the MLP's, :meth:`AutogradPaths._with_post`);
* an ``nn.ModuleList``: Linear triples grouped, any other expert called on its own rows (idle experts
  on zero rows, :meth:`AutogradPaths._module_list_forward`);
* parameters shared by every expert, over more than one rank: the experts run once per source rank,
  each run on its own view of them, so that each rank gets the gradient of its own rows
  (:meth:`AutogradPaths._by_source`, :func:`epmoe.ep.grads.shared_by_source`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from epmoe import errors
from epmoe.comm.layout import inverse_permutation
from epmoe.ep.expert_lora import post_module
from epmoe.ep.expert_weights import WeightsHook, as_is
from epmoe.ep.grads import shared_by_source
from epmoe.ep.mlp import expert_mlp
from epmoe.ep.recognize import num_experts_of
from epmoe.ep.routing import RowPairs, RowSources
from epmoe.gmm import grouped_mm
from epmoe.gmm.backend import prefix


class AutogradPaths:
    """The local experts' plain-autograd paths (see the module docstring)."""

    def forward(
        self, x_em: torch.Tensor, counts: Sequence[int] | torch.Tensor, *, sync_weights: WeightsHook | None = None
    ) -> torch.Tensor:
        """The local experts on ``x_em``; ``counts[j]`` consecutive rows go to expert ``j``.

        ``x_em``: ``(A, H)``, rows expert-major. ``counts``: ints, or a 1-D integer tensor, which the
        grouped matmuls read where they run (so a caller whose counts are on the device keeps them
        there: ``torch.compile`` traces it; see :attr:`~epmoe.ep.expert_weights.ExpertWeights.grouped`).
        Returns ``(A, H)`` in the same order. ``sync_weights`` (the engine's gradient policy,
        :mod:`epmoe.ep.grads`) receives the weight tensors the grouped matmuls are about to use and
        returns those to use instead (same values); experts run by their own forward hand it their
        parameters with ``per_parameter=True`` (nothing to substitute).
        """
        if isinstance(counts, torch.Tensor):
            errors.check_counts_tensor("experts_forward(counts)", counts)
        else:
            counts = errors.int_list("experts_forward(counts)", counts)
        if len(counts) != num_experts_of(self.module):
            raise ValueError(f"experts_forward(counts): {len(counts)} counts for {num_experts_of(self.module)} experts")
        sync_weights = sync_weights or as_is
        if self.weights.packed:
            return self._packed_forward(x_em, counts, sync_weights)
        return self._module_list_forward(x_em, counts, sync_weights)

    def _split_shared(self) -> bool:
        """Whether a forward must split the shared parameters' gradients by source rank: some need a
        gradient and this forward records one."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        return torch.is_grad_enabled() and any(named[n].requires_grad for n in self.weights.shared_names)

    def _by_source(
        self,
        x_PH: torch.Tensor,
        counts: list[int] | torch.Tensor,
        *,
        pairs: RowPairs,
        K: int,
        sources: RowSources,
        sync_weights: WeightsHook,
    ) -> torch.Tensor:
        """:meth:`forward` on the pairs ``x_PH`` (expert-major, counts ``counts``), run once per source
        rank on that rank's pairs, each run seeing its own view of every shared parameter
        (:func:`~epmoe.ep.grads.shared_by_source`, whose backward sends each source rank the gradient
        its rows gave); the per-expert weights are synced once for all runs. Rows ``R`` are
        source-major (``sources.rows_W[s]`` rows from rank ``s``); a pair's row is ``slot_P // K``.
        Exact wherever the shared parameters act on each row alone (a norm, a scale, a bias)."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        modules = dict(self.module.named_modules(remove_duplicate=False))
        params = list({id(named[n]): named[n] for n in self.weights.shared_names}.values())
        index = {id(p): i for i, p in enumerate(params)}
        holders = {}  # one name per module attribute holding a shared parameter (a shared module: one)
        for name in self.weights.shared_names:
            owner, _, attr = name.rpartition(".")
            holders.setdefault((id(modules[owner]), attr), name)
        x_PH, views = shared_by_source(x_PH, params, sources.group)
        synced = {}

        def sync_once(weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
            key = (per_parameter, tuple(id(w) for w in weights))
            if key not in synced:
                synced[key] = sync_weights(weights, per_parameter=per_parameter)
            return synced[key]

        device = x_PH.device
        ends_W = torch.tensor(list(itertools.accumulate(sources.rows_W)), device=device)
        source_P = torch.bucketize(pairs.slot_P // K, ends_W, right=True)
        counts_e = torch.as_tensor(counts, device=device)
        expert_P = torch.repeat_interleave(
            torch.arange(counts_e.numel(), device=device), counts_e, output_size=x_PH.shape[0]
        )
        call = _ExpertsCall(self.module, functools.partial(self.forward, sync_weights=sync_once))
        outs, order = [], []
        for s, view in enumerate(views):
            index_p = torch.nonzero(source_P == s).squeeze(1)  # ascending: still expert-major
            counts_s = torch.bincount(expert_P[index_p], minlength=counts_e.numel()).tolist()
            stand_ins = {f"experts.{n}": view[index[id(named[n])]] for n in holders.values()}
            outs.append(torch.func.functional_call(call, stand_ins, (x_PH[index_p], counts_s), tie_weights=False))
            order.append(index_p)
        return torch.cat(outs)[inverse_permutation(torch.cat(order))]

    def _packed_forward(
        self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
    ) -> torch.Tensor:
        module = self.module
        if self.post is not None:
            return self._with_post(x_em, counts, sync_weights)
        _, y = self._grouped_mlp(x_em.to(self.weights.compute_dtype(self.weights.weight_dtype())), counts, sync_weights)
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        return y

    def _with_post(
        self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
    ) -> torch.Tensor:
        """The grouped MLP, then the per-expert post module on each row with its local expert's id
        (``ids_em``, expert-major as the rows). Its parameters are per expert: synced with the MLP's
        weights, in one call of ``sync_weights``, and stood in for by name."""
        post = post_module(self.module, self.post)  # under a LoRA wrapper of the experts module; LoRA on it refused
        names = [name for name, _ in post.named_parameters()]
        post_weights = [post.get_parameter(name) for name in names]
        synced = {}

        def with_post_weights(weights: list[torch.Tensor], *, per_parameter: bool = False) -> list[torch.Tensor]:
            out = sync_weights([*weights, *post_weights], per_parameter=per_parameter)
            synced.update(zip(names, out[len(weights) :]))
            return out[: len(weights)]

        _, y_em = self._grouped_mlp(
            x_em.to(self.weights.compute_dtype(self.weights.weight_dtype())), counts, with_post_weights
        )
        counts_e = torch.as_tensor(counts, device=y_em.device)
        ids_em = torch.repeat_interleave(
            torch.arange(counts_e.numel(), device=y_em.device), counts_e, output_size=y_em.shape[0]
        )
        return torch.func.functional_call(post, synced, (y_em, ids_em), tie_weights=False)

    def _grouped_mlp(
        self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~epmoe.ep.mlp.expert_mlp` through :func:`epmoe.grouped_mm` (plain autograd), on
        the backend :attr:`gmm` chose (asked inside the op: nothing of the choice is traced)."""
        up, down, up_bias, down_bias = self.weights.read(sync_weights)
        trans_weight, choice = self.weights.trans_weight, self.gmm
        return expert_mlp(
            x_em,
            counts,
            up,
            down,
            up_bias,
            down_bias,
            self.gate_activation,
            lambda x, w: grouped_mm(x, w, counts, trans_weight=trans_weight, backend=choice),
        )

    def _module_list_forward(
        self, x_em: torch.Tensor, counts: list[int] | torch.Tensor, sync_weights: WeightsHook
    ) -> torch.Tensor:
        experts = self.module
        if self.weights.triples is not None:
            return self._grouped_mlp(x_em, counts, sync_weights)[1]
        sync_weights(self.weights.expert_parameters(), per_parameter=True)
        if isinstance(counts, torch.Tensor):
            counts = errors.int_list("experts_forward(counts)", counts)
        # Idle experts run too, on zero rows: autograd then gives their parameters exact-zero
        # gradients (as the grouped paths do), not None; it also keeps the output connected to x_em,
        # whose exchange must run in backward on every rank.
        starts = prefix(counts)
        return torch.cat([expert(x_em[starts[j] : starts[j + 1]]) for j, expert in enumerate(experts)])


class _ExpertsCall(nn.Module):
    """``run(x, counts)`` as the forward of a module holding the experts module as ``experts``, so that
    ``torch.func.functional_call`` can stand tensors in for the experts' parameters by name."""

    def __init__(self, experts: nn.Module, run: Callable[[torch.Tensor, list[int]], torch.Tensor]):
        super().__init__()
        self.experts = experts
        self.run = run

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.run(x, counts)
