"""The optimizer a Trainer builds, its param groups split for the engine that steps it.

DeepSpeed wants the expert parameters in its own MoE groups, FSDP2 in groups apart from its DTensors;
both need the split on the optimizer Trainer creates itself (``Trainer.create_optimizer``), for this
trainer only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def split_groups_of_created_optimizer(trainer: Any, split: Callable[[Any], None]) -> None:
    """Make ``trainer.create_optimizer`` apply ``split`` to the optimizer it creates (once per trainer)."""
    if getattr(trainer, "_epmoe_create_optimizer", None) is not None:
        return
    create_optimizer = trainer.create_optimizer

    def create_with_split_groups(*args: Any, **kwargs: Any) -> Any:
        optimizer = create_optimizer(*args, **kwargs)
        split(optimizer)
        return optimizer

    trainer._epmoe_create_optimizer = create_optimizer
    trainer.create_optimizer = create_with_split_groups
