"""Composition: what turns a model into an EP model, on top of the engine, model knowledge,
training and checkpoints.

* :mod:`epmoe.compose.apply`: ``apply_expert_parallel``: find the experts, shard them, agree across
  ranks, swap the forwards, attach what training and saving need.
* :mod:`epmoe.compose.pretrained`: ``from_pretrained``: the same while transformers loads, each rank
  reading only its experts.
* :mod:`epmoe.compose.twinkle`: ``prepare_twinkle``: the same on a twinkle ``TransformersModel``, with
  its FSDP2 wrap, clip, LoRA and saves made exact.
* :mod:`epmoe.compose.run`: what ``epmoe run`` hooks in its command's processes (``from_pretrained``,
  ``Trainer.__init__``), imported only there, by the bootstrap.
"""

from epmoe.compose.apply import apply_expert_parallel, resolve_groups
from epmoe.compose.pretrained import from_pretrained
from epmoe.compose.twinkle import prepare_twinkle

__all__ = ["apply_expert_parallel", "from_pretrained", "prepare_twinkle", "resolve_groups"]
