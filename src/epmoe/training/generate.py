"""``generate`` on an EP model: every rank keeps serving the others' exchanges until all are done.

Each decoding step is a forward, and each MoE layer of a forward exchanges tokens with every EP
rank. A rank whose sequences finish first (EOS, or a smaller ``max_new_tokens``) would leave the
others waiting in their next all-to-all. transformers' ``synced_gpus=True`` is the cure: each step
all-reduces "am I done", and a finished rank keeps running forwards (their outputs discarded) until
every rank is. :func:`epmoe.apply_expert_parallel` installs :class:`SyncedGenerate` as the model's
``generate`` (an instance attribute; the class is untouched), which makes that the default.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


class SyncedGenerate:
    """``model.generate`` with ``synced_gpus=True`` unless the caller says otherwise.

    ``synced_gpus=False`` raises ``ValueError``: on an EP model it hangs as soon as one rank stops
    before the others.
    """

    @staticmethod
    def applies_to(model: nn.Module) -> bool:
        """Whether ``model``'s class has a ``generate`` taking ``synced_gpus`` (transformers', or one
        passing keywords on, like PEFT's)."""
        generate = getattr(type(model), "generate", None)
        if not callable(generate):
            return False
        try:
            params = inspect.signature(generate).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.name == "synced_gpus" or p.kind is p.VAR_KEYWORD for p in params)

    def __init__(self, model: nn.Module):
        self.model = model  # deepcopy of the model copies this reference to the copy

    def __call__(self, *args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        if synced_gpus is False:
            raise ValueError(
                "generate(synced_gpus=False) on an expert-parallel model: a rank that finishes first would leave "
                "the others waiting in their next all-to-all; leave synced_gpus unset (epmoe sets it to True)"
            )
        return type(self.model).generate(self.model, *args, synced_gpus=True, **kwargs)

    def __repr__(self) -> str:
        return f"<epmoe synced generate of {type(self.model).__name__}>"
