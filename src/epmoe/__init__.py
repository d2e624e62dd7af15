"""epmoe: expert-parallel Mixture-of-Experts for PyTorch, on every accelerator.

The data path of one MoE layer, and where each step lives::

    router (the model's own)                 untouched
      -> counts exchange                     epmoe.ep.dispatch.base on epmoe.comm.counts
      -> dispatch (rows + all-to-all-v)      epmoe.ep.dispatch      (.alltoallv; .fused: alltoallv_gmm)
      -> grouped experts                     epmoe.ep.experts, epmoe.ep.mlp (epmoe::routed_mlp) on epmoe.gmm
      -> combine (all-to-all-v + sum)        epmoe.ep.dispatch      (.alltoallv; .fused: gmm_alltoallv)
    (the whole layer: epmoe.ep.layer.routed_experts; the floors of the package: docs/design.md)

The collectives of a training step on a model's EP groups carry or follow step headers
(:mod:`epmoe.comm.steps`), so ranks out of step raise on every rank, and run on groups whose waits
end after ``ExpertParallelConfig.timeout``.
Device-specific calls all live in :mod:`epmoe.platform`; what training around the engine needs
(DDP, FSDP2, EP x DP meshes, clipping, Trainer, generate) in :mod:`epmoe.training`.
"""

from epmoe import platform
from epmoe.checkpoint import adapter_state_dict, get_state_dict, set_state_dict
from epmoe.comm import alltoallv_gmm, exchange_counts, gmm_alltoallv
from epmoe.comm.steps import OutOfStepError
from epmoe.compose import apply_expert_parallel, from_pretrained, prepare_twinkle
from epmoe.ep import ExpertParallelConfig, ExpertShard
from epmoe.ep.load import expert_load, load_summary, reset_expert_load
from epmoe.ep.model import EPModel
from epmoe.ep.params import expert_parameters, is_expert_parameter, parameter_counts
from epmoe.ep.state import ep_model
from epmoe.gmm import BackendStatus, GmmBackend, gmm_backends, grouped_mm, register_gmm_backend
from epmoe.integrations import transformers_ep, transformers_experts
from epmoe.training import (
    LoadBalancer,
    RoutingRecord,
    clip_grad_norm_,
    prepare_accelerator,
    prepare_deepspeed,
    prepare_trainer,
    record_routing,
    reference_model,
    replay_rollout_routing,
    replay_routing,
    routes_from_vllm,
)

transformers_experts.register()  # experts_implementation="epmoe" in transformers, where installed
transformers_ep.register()  # DistributedConfig(ep_implementation="epmoe"), where transformers has its own EP

__version__ = "0.1.0"

__all__ = [
    "BackendStatus",
    "adapter_state_dict",
    "ExpertParallelConfig",
    "ExpertShard",
    "alltoallv_gmm",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "ep_model",
    "EPModel",
    "exchange_counts",
    "expert_load",
    "expert_parameters",
    "from_pretrained",
    "gmm_alltoallv",
    "GmmBackend",
    "get_state_dict",
    "gmm_backends",
    "grouped_mm",
    "is_expert_parameter",
    "load_summary",
    "LoadBalancer",
    "OutOfStepError",
    "parameter_counts",
    "platform",
    "prepare_accelerator",
    "prepare_deepspeed",
    "prepare_trainer",
    "prepare_twinkle",
    "record_routing",
    "reference_model",
    "register_gmm_backend",
    "replay_rollout_routing",
    "replay_routing",
    "reset_expert_load",
    "routes_from_vllm",
    "RoutingRecord",
    "set_state_dict",
]
