"""Dispatch and combine: how a layer's tokens reach their local experts and come back.

A *transport* is one way of moving them (``ExpertParallelConfig.dispatch`` names it); its
:class:`~epmoe.ep.dispatch.base.Dispatcher` does it. One interface (:mod:`~epmoe.ep.dispatch.base`),
one module per transport, each dispatcher built once per layer when EP is applied and kept as the
layer state's ``transport``::

    hidden_TH, top_k_index_TK, top_k_weights_TK
      --dispatch--> rows on the experts' ranks (+ meta: this call's counts, indices, weights)
      --experts-->  their outputs
      --combine-->  out_TH

* :mod:`~epmoe.ep.dispatch.alltoallv` (``"alltoallv"``): each token once per rank holding one of its
  experts, all-to-all-v around ``epmoe::routed_mlp``; a group of one moves nothing.
* :mod:`~epmoe.ep.dispatch.fused` (``"fused"``): the vendor ops' per-slot layout, the MLP split
  across ``alltoallv_gmm`` / ``gmm_alltoallv``, a block's shared expert in their gaps.
* :mod:`~epmoe.ep.dispatch.static` (``"static"``): fixed-size buffers of ``B >= T`` rows per rank
  pair, padded: no counts exchange and no host read, traced whole by ``torch.compile``.

``"auto"`` is resolved when EP is applied (:func:`epmoe.compose.apply.apply_expert_parallel`): to
``"alltoallv"`` on every device, which sends each token once per rank holding its experts, where the
fused ops' per-slot layout sends it once per expert; on CPU ``benchmarks/fused_cpu.md`` also measured
no gain from the fused ops' rounds (not measured on an accelerator). It takes ``"static"`` only at
the decode steps of epmoe's ``generate``, where the ranks run in lockstep
(:meth:`~epmoe.ep.config.ExpertParallelConfig.decodes_static`); a sync-free static exchange
everywhere must know the largest batch (``static_tokens``), which only the user can choose
(``benchmarks/static_cpu.md``).
"""

from __future__ import annotations

from torch import nn

from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.dispatch.alltoallv import AllToAllVDispatcher
from epmoe.ep.dispatch.base import Dispatcher, SharedExpert
from epmoe.ep.dispatch.fused import FusedDispatcher
from epmoe.ep.dispatch.static import StaticDispatcher

DISPATCHERS: dict[str, type[Dispatcher]] = {
    cls.name: cls for cls in (AllToAllVDispatcher, FusedDispatcher, StaticDispatcher)
}


def make_dispatcher(name: str, experts: nn.Module, config: ExpertParallelConfig) -> Dispatcher:
    """The dispatcher of transport ``name`` (a key of :data:`DISPATCHERS`) for the experts module
    ``experts`` (packed, or an ``nn.ModuleList``), built once per layer."""
    if name not in DISPATCHERS:
        raise ValueError(f"make_dispatcher(name): {name!r} is not one of {sorted(DISPATCHERS)}")
    return DISPATCHERS[name](experts, config)


__all__ = ["DISPATCHERS", "Dispatcher", "SharedExpert", "make_dispatcher"]
