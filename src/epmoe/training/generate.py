"""``generate`` on an EP model: every rank keeps serving the others' exchanges until all are done.

Each decoding step is a forward, and each MoE layer of a forward exchanges tokens with every EP
rank. A rank whose sequences finish first (EOS, or a smaller ``max_new_tokens``) would leave the
others waiting in their next all-to-all. transformers' ``synced_gpus=True`` is the cure: each step
all-reduces "am I done", and a finished rank keeps running forwards (their outputs discarded) until
every rank is. :func:`epmoe.apply_expert_parallel` installs :class:`SyncedGenerate` as the model's
``generate`` (an instance attribute; the class is untouched), which makes that the default.

That lockstep is also what lets ``dispatch="auto"`` take the static exchange at the decode steps
(:meth:`epmoe.ExpertParallelConfig.decodes_static`): for the call, each layer's dispatcher becomes a
:class:`~epmoe.ep.dispatch.static.DecodeDispatcher`, which runs the layer's first forward of the call
(the prompt, training-sized) on the all-to-all-v and every later one (one token per sequence) on the
static exchange. Every rank counts the same forwards, so every rank switches at the same one; the
layers get their dispatchers back when the call returns or raises::

    forward of the call   0 (prompt)        1, 2, ... (decode steps)
    transport             all-to-all-v      static: 2 collectives per layer instead of 4
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from epmoe.ep.dispatch import DecodeDispatcher
from epmoe.ep.state import sharded_experts
from epmoe.ep.transports import decode_dispatcher, static_ineligible_reason


class SyncedGenerate:
    """``model.generate`` with ``synced_gpus=True`` unless the caller says otherwise; its ``__self__`` and
    ``__func__`` are those of the bound method it replaces.

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

    # read as the bound method it stands for: frameworks look at model.generate.__func__ (LLaMA-Factory's
    # patch_model rebinds GenerationMixin.generate where that does not name it, which would drop this)
    @property
    def __self__(self) -> nn.Module:
        return self.model

    @property
    def __func__(self) -> Any:
        return type(self.model).generate

    def __call__(self, *args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        if synced_gpus is False:
            raise ValueError(
                "generate(synced_gpus=False) on an expert-parallel model: a rank that finishes first would leave "
                "the others waiting in their next all-to-all; leave synced_gpus unset (epmoe sets it to True)"
            )
        with static_decode_steps(self.model):
            return type(self.model).generate(self.model, *args, synced_gpus=True, **kwargs)

    def __repr__(self) -> str:
        return f"<epmoe synced generate of {type(self.model).__name__}>"


@contextmanager
def static_decode_steps(model: nn.Module) -> Iterator[None]:
    """For one generate call on ``model``: every sharded layer whose config's ``dispatch="auto"``
    takes the static exchange at decode steps (:meth:`~epmoe.ExpertParallelConfig.decodes_static`)
    and whose experts it can run gets a :class:`~epmoe.ep.dispatch.static.DecodeDispatcher` (a fresh
    buffer, agreed at the first decode step); the layers' own dispatchers are back afterwards. A
    generate call inside one (an assistant sharing the layers) leaves them as they are."""
    swapped = []
    for _, _, state in sharded_experts(model):
        if (
            state.model.config.decodes_static()
            and not isinstance(state.transport, DecodeDispatcher)
            and not state.experts.weights.shared_names  # found before sharding (the local shapes cannot tell)
            and static_ineligible_reason(state.local_experts) is None
        ):
            swapped.append((state, state.transport))
            state.transport = decode_dispatcher(state.transport)
    try:
        yield
    finally:
        for state, transport in swapped:
            state.transport = transport
