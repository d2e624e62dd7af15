"""Checkpoints of EP models.

* :mod:`epmoe.checkpoint.save`: ``save_pretrained`` writes every expert (a plain transformers checkpoint).
* :mod:`epmoe.checkpoint.dcp`: ``get_state_dict`` / ``set_state_dict`` for ``torch.distributed.checkpoint``.
"""

from epmoe.checkpoint.dcp import get_state_dict, set_state_dict

__all__ = ["get_state_dict", "set_state_dict"]
