"""The optimizer a Trainer builds, its param groups split for the engine that steps it.

FSDP2 wants the expert parameters in groups apart from its DTensors, on the optimizer Trainer creates
itself (``Trainer.create_optimizer``, for this trainer only). DeepSpeed's MoE groups are made with
DeepSpeed's own helper where the optimizer reaches ``accelerator.prepare`` (:mod:`epmoe.training.deepspeed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from epmoe.training.launchers import remember, remembered, replace

SPLITS = "create_optimizer splits groups"


def split_groups_of_created_optimizer(trainer: Any, split: Callable[[Any, str], None]) -> None:
    """Make ``trainer.create_optimizer`` apply ``split`` to the optimizer it creates (once per trainer)."""
    if remembered(trainer, SPLITS):
        return
    create_optimizer = trainer.create_optimizer

    def create_with_split_groups(*args: Any, **kwargs: Any) -> Any:
        optimizer = create_optimizer(*args, **kwargs)
        split(optimizer, "prepare_trainer")
        return optimizer

    replace(trainer, "create_optimizer", create_with_split_groups)
    remember(trainer, SPLITS)


def split_param_groups(optimizer: Any, own_group: Callable[[dict, nn.Parameter], dict | None], caller: str) -> None:
    """Move parameters of ``optimizer`` (a torch optimizer that has not stepped) into groups of their
    own: ``own_group(group, p)`` gives the options that set ``p``'s new group apart (``None``: ``p``
    stays), the original group's options kept. Anything but a torch optimizer is left alone.
    ``caller`` names the public function in errors."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    if optimizer.state:
        raise ValueError(f"{caller}: the optimizer has already stepped; prepare before training")
    kept, added = [], []
    for group in optimizer.param_groups:
        rest, own = [], {}
        for p in group["params"]:
            options = own_group(group, p)
            if options is None:
                rest.append(p)
            else:
                own.setdefault(tuple(sorted(options.items())), []).append(p)
        if not own:
            kept.append(group)
            continue
        if rest:
            kept.append({**group, "params": rest})
        added += [{**group, **dict(options), "params": params} for options, params in own.items()]
    optimizer.param_groups = kept
    for group in added:
        optimizer.add_param_group(group)
