"""Dispatch and combine: how a layer's tokens reach their local experts and come back.

A *transport* is one way of moving them (``ExpertParallelConfig.dispatch`` names it); its
:class:`~epmoe.ep.dispatch.base.Dispatcher` does it, and only that: the layer
(:mod:`epmoe.ep.layer`) runs the rest of the call. One interface (:mod:`~epmoe.ep.dispatch.base`),
one module per transport, each dispatcher built once per layer when EP is applied
(:mod:`epmoe.ep.transports`) and kept as the layer state's ``transport``::

    hidden_TH, top_k_index_TK, top_k_weights_TK, link (what the layer knows of this call)
      --dispatch--> rows on the experts' ranks (+ meta: this call's indices, weights, what arrived)
      (the layer: the local experts on the rows)
      --combine-->  out_TH

* :mod:`~epmoe.ep.dispatch.alltoallv` (``"alltoallv"``): each token once per rank holding one of its
  experts, all-to-all-v around ``epmoe::routed_mlp``; a group of one moves nothing.
* :mod:`~epmoe.ep.dispatch.fused` (``"fused"``): the vendor ops' per-slot layout, the MLP split
  across ``alltoallv_gmm`` / ``gmm_alltoallv``, a block's shared expert in their gaps.
* :mod:`~epmoe.ep.dispatch.nodes` (``"nodes"``): two levels, each token once to each node holding
  one of its experts (to the rank at the sender's local index there), then inside the node to the
  ranks holding them; the combine sums inside the node first.
* :mod:`~epmoe.ep.dispatch.static` (``"static"``): fixed-size buffers of ``B >= T`` rows per rank
  pair, padded: no counts exchange and no host read, traced whole by ``torch.compile``.
* :mod:`~epmoe.ep.dispatch.shared`: an EP group whose ranks hold the same batch (transformers' EP
  with ``ep_size == tp_size``, :mod:`epmoe.integrations.transformers_ep`; no ``dispatch`` value):
  nothing moves, the ranks' partial outputs are summed.

Not a transport: :mod:`~epmoe.ep.dispatch.replica_rows`, the rows of a call under a replica plan
(:mod:`epmoe.ep.replicas`), sent and read on arrival alike by the all-to-all-v and the two-level
exchange, which add only their hops.

``"auto"`` is resolved when EP is applied (:func:`epmoe.compose.apply.apply_expert_parallel`): to
``"nodes"`` where the EP group spans more than one node with more than one of its ranks on each
(:mod:`epmoe.ep.topology`), else to ``"alltoallv"`` on every device, which sends each token once per rank holding its experts, where the
fused ops' per-slot layout sends it once per expert; on CPU ``benchmarks/fused_cpu.md`` also measured
no gain from the fused ops' rounds (not measured on an accelerator). It takes ``"static"`` only at
the decode steps of epmoe's ``generate``, where the ranks run in lockstep
(:meth:`~epmoe.ep.config.ExpertParallelConfig.decodes_static`); a sync-free static exchange
everywhere must know the largest batch (``static_tokens``), which only the user can choose
(``benchmarks/static_cpu.md``).
"""

from __future__ import annotations

from epmoe.ep.dispatch.alltoallv import AllToAllVDispatcher
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, RoutedRows, SharedExpert
from epmoe.ep.dispatch.fused import FusedDispatcher
from epmoe.ep.dispatch.nodes import NodeGroups, NodesDispatcher
from epmoe.ep.dispatch.shared import SharedBatchDispatcher
from epmoe.ep.dispatch.static import DecodeDispatcher, StaticDispatcher

__all__ = [
    "AllToAllVDispatcher",
    "Arrived",
    "DecodeDispatcher",
    "Dispatcher",
    "FusedDispatcher",
    "Link",
    "NodeGroups",
    "NodesDispatcher",
    "RoutedRows",
    "SharedBatchDispatcher",
    "SharedExpert",
    "StaticDispatcher",
]
