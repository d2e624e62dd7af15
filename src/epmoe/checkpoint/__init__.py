"""Checkpoints of EP models.

* :mod:`epmoe.checkpoint.save`: ``save_pretrained`` writes every expert (a plain transformers checkpoint);
  ``adapter_state_dict`` completes PEFT adapters with LoRA on the experts.
* :mod:`epmoe.checkpoint.load`: reading only each rank's experts (``epmoe.from_pretrained``,
  :mod:`epmoe.compose.pretrained`, loads through it).
* :mod:`epmoe.checkpoint.dcp`: ``get_state_dict`` / ``set_state_dict`` for ``torch.distributed.checkpoint``.
"""

from epmoe.checkpoint.dcp import get_state_dict, set_state_dict
from epmoe.checkpoint.save import adapter_state_dict

__all__ = ["adapter_state_dict", "get_state_dict", "set_state_dict"]
