"""A warning where a bare ``state_dict()`` of an EP model would lose or swap experts.

``model.state_dict()`` on an EP model holds only this rank's experts, under the names the unsharded
model uses for all of them: ``torch.save`` of it on one rank writes an incomplete model, and
``dcp.save`` of it treats every rank's block as a replica of one tensor (a load then gives every
rank the same experts). Each sharded experts module carries a state-dict post-hook that warns
(:class:`ExpertStateDictWarning`, once per call site) naming what to call instead. epmoe's own
saving paths (``save_pretrained`` of an EP model, :func:`epmoe.get_state_dict`,
:func:`epmoe.set_state_dict`) take the state dict inside :func:`own_state_dict` and do not warn.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator

from torch import nn

from epmoe.ep.state import state_of

_OWN = contextvars.ContextVar("epmoe_own_state_dict", default=False)


class ExpertStateDictWarning(UserWarning):
    """A state dict of an expert-parallel model, taken outside epmoe's checkpoint functions."""


@contextlib.contextmanager
def own_state_dict() -> Iterator[None]:
    """State dicts taken inside are epmoe's own (they are gathered or resharded): no warning."""
    token = _OWN.set(True)
    try:
        yield
    finally:
        _OWN.reset(token)


def warn_on_bare_state_dict(module: nn.Module) -> None:
    """Register the warning hook on one sharded experts module."""
    module.register_state_dict_post_hook(_warn)


def _warn(module, state_dict, prefix, local_metadata) -> None:
    if _OWN.get():
        return
    shard = state_of(module).shard
    warnings.warn(
        f"epmoe: this state_dict holds only this rank's experts of {prefix.rstrip('.') or 'the model'} "
        f"({shard.num_local_experts} of {shard.num_experts}) under the unsharded names: torch.save or dcp.save "
        f"of it would lose or swap experts. Save with model.save_pretrained(path) on every rank, or "
        f"epmoe.get_state_dict(model, optimizer) for torch.distributed.checkpoint; a PEFT adapter with "
        f"peft_model.save_pretrained(path, state_dict=epmoe.adapter_state_dict(peft_model))",
        ExpertStateDictWarning,
        stacklevel=3,
    )
