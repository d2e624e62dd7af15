"""Training with the tools users already use: DDP, FSDP2, EP x DP meshes, clipping, Trainer, generate.

Which parameters are expert-parallel (DDP told to leave them alone) and how their gradients are
reduced over ``"dp"`` and summed or averaged is the engine's contract: :mod:`epmoe.ep.params`,
:mod:`epmoe.ep.grads`. Here:

* :mod:`epmoe.training.launchers`: the launcher table (every method of another library epmoe
  replaces, overrides or calls, with the versions it was checked against) and the registry of what
  was prepared.
* :mod:`epmoe.training.clip`: the whole model's gradient norm, every expert counted once.
* :mod:`epmoe.training.trainer`: ``prepare_trainer`` for transformers' ``Trainer``.
* :mod:`epmoe.training.accelerate`: ``prepare_accelerator`` for an accelerate ``Accelerator`` (DDP,
  FSDP2, or its DeepSpeed plugin through :mod:`epmoe.training.deepspeed`).
* :mod:`epmoe.training.deepspeed`: ``prepare_deepspeed``, DeepSpeed ZeRO 1/2 through its own MoE support.
* :mod:`epmoe.training.generate`: ``generate`` that never leaves a rank waiting.
* :mod:`epmoe.training.balance`: ``LoadBalancer``, auxiliary-loss-free balancing of expert load.
* :mod:`epmoe.training.replay`: routing replay (R3): ``record_routing``, ``replay_routing``, ``routes_from_vllm``;
  :mod:`epmoe.training.grpo`: ``replay_rollout_routing``, the same inside TRL's ``GRPOTrainer``.
* :mod:`epmoe.training.reference`: ``reference_model``, a frozen EP twin for DPO's / GRPO's reference.
"""

from epmoe.ep.params import expert_parameters, is_expert_parameter  # their home before the engine took them
from epmoe.training.accelerate import prepare_accelerator
from epmoe.training.balance import LoadBalancer
from epmoe.training.clip import clip_grad_norm_
from epmoe.training.deepspeed import prepare_deepspeed
from epmoe.training.grpo import replay_rollout_routing
from epmoe.training.reference import reference_model
from epmoe.training.replay import RoutingRecord, record_routing, replay_routing, routes_from_vllm
from epmoe.training.trainer import prepare_trainer

__all__ = [
    "LoadBalancer",
    "RoutingRecord",
    "clip_grad_norm_",
    "expert_parameters",
    "is_expert_parameter",
    "prepare_accelerator",
    "prepare_deepspeed",
    "prepare_trainer",
    "record_routing",
    "reference_model",
    "replay_rollout_routing",
    "replay_routing",
    "routes_from_vllm",
]
