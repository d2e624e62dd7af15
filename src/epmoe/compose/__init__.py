"""Composition: what turns a model into an EP model, on top of the engine, model knowledge,
training and checkpoints.

* :mod:`epmoe.compose.apply`: ``apply_expert_parallel``: find the experts, shard them, agree across
  ranks, swap the forwards, attach what training and saving need.
* :mod:`epmoe.compose.pretrained`: ``from_pretrained``: the same while transformers loads, each rank
  reading only its experts.
"""

from epmoe.compose.apply import apply_expert_parallel, resolve_groups
from epmoe.compose.pretrained import from_pretrained

__all__ = ["apply_expert_parallel", "from_pretrained", "resolve_groups"]
