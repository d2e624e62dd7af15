"""Training with the tools users already use: DDP, FSDP2, EP x DP meshes, clipping, Trainer, generate.

* :mod:`epmoe.training.params`: which parameters are expert-parallel; DDP told to leave them alone.
* :mod:`epmoe.training.grads`: expert gradients reduced over ``"dp"`` and summed or averaged.
* :mod:`epmoe.training.clip`: the whole model's gradient norm, every expert counted once.
* :mod:`epmoe.training.trainer`: ``prepare_trainer`` for transformers' ``Trainer``.
* :mod:`epmoe.training.generate`: ``generate`` that never leaves a rank waiting.
* :mod:`epmoe.training.balance`: ``LoadBalancer``, auxiliary-loss-free balancing of expert load.
"""

from epmoe.training.balance import LoadBalancer
from epmoe.training.clip import clip_grad_norm_
from epmoe.training.params import expert_parameters, is_expert_parameter
from epmoe.training.trainer import prepare_trainer

__all__ = ["LoadBalancer", "clip_grad_norm_", "expert_parameters", "is_expert_parameter", "prepare_trainer"]
