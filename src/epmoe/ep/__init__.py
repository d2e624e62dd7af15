"""The expert-parallel engine: what runs inside an EP layer, in data-path order.

* :mod:`~epmoe.ep.config`: ``ExpertParallelConfig``, ``ExpertShard``.
* :mod:`~epmoe.ep.recognize`: which modules are experts (packed, Linear triples), PEFT wrappers.
* :mod:`~epmoe.ep.probe`: running a module's own forward on fixed rows where its structure cannot tell.
* :mod:`~epmoe.ep.model`: ``EPModel``, one model's expert parallelism (groups, step channels, gradient
  policy, step guard, the experts modules in order), and which wrapper runs the model.
* :mod:`~epmoe.ep.state`: the per-layer record pointing to it, and the queries (``ep_model``, ``ep_states``).
* :mod:`~epmoe.ep.routing`: a layer's rows and pairs (the all-to-all-v transport's indices).
* :mod:`~epmoe.ep.position`, :mod:`~epmoe.ep.counts`, :mod:`~epmoe.ep.counters`: a layer's place in
  the step, its counts exchange, its routed-load counters.
* :mod:`~epmoe.ep.dispatch`: the transports (dispatch and combine, one module each), which only move
  tokens; :mod:`~epmoe.ep.transports` builds a layer's from its experts module.
* :mod:`~epmoe.ep.expert_weights`: the local experts' weights and layout (packed or ``ModuleList``,
  Linear triples, shared parameters, compute dtype); :mod:`~epmoe.ep.expert_lora`: PEFT wrappers
  put around them.
* :mod:`~epmoe.ep.experts`: the local experts' compute (grouped, or their own forwards), the
  grouped-matmul backend chosen once per experts module.
* :mod:`~epmoe.ep.mlp`: the one expert MLP (up -> gate -> down), ``epmoe::routed_mlp`` and its backward.
* :mod:`~epmoe.ep.layer`: ``routed_experts``, one layer call: the protocol, in order.
* :mod:`~epmoe.ep.grads`, :mod:`~epmoe.ep.params`: the expert-gradient policy (``"dp"``
  reduction, sum / mean) and which parameters are expert-parallel.
* :mod:`~epmoe.ep.guard`: the step guard (a clip epmoe did not do, replicas that drifted).
* :mod:`~epmoe.ep.load`: expert-load telemetry.
* :mod:`~epmoe.ep.lora`: PEFT LoRA factors on sharded experts start as the unsharded model's.

Nothing here imports model knowledge, training, checkpoints or composition (the floors above).
"""

from epmoe.ep.config import ExpertParallelConfig, ExpertShard

__all__ = ["ExpertParallelConfig", "ExpertShard"]
