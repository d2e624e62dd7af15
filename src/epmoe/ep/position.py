"""Where a layer is in the step: its forward calls, and the positions its step headers name.

Each forward of an experts module is the layer's next *call* (:meth:`LayerPosition.next_call`); the
headers of that forward's exchanges, of its backward (:meth:`LayerPosition.backward_header`) and of
its expert-gradient reduction name ``(layer, phase, call)`` (:class:`~epmoe.comm.steps.Position`),
so ranks out of step raise on every rank (:mod:`epmoe.comm.steps`). A forward traced by
``torch.compile`` does not count (an int that changed per call would recompile it): its headers
carry the call number of the tracing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epmoe.comm.steps import BACKWARD, FORWARD, BackwardHeader, Position, StepChannel


@dataclass
class LayerPosition:
    """One experts module's place in the step: ``layer``, its index among the model's experts
    modules, and ``calls``, its forwards so far."""

    layer: int = 0
    calls: int = 0

    def next_call(self) -> Position:
        """The forward position of the layer's next call (counted outside ``torch.compile``)."""
        if not torch.compiler.is_compiling():
            self.calls += 1
        return Position(self.layer, FORWARD, self.calls)

    def at(self, phase: int) -> Position:
        """Where this layer is for ``phase``: its latest forward call."""
        return Position(self.layer, phase, self.calls)

    def backward_header(self, out_TH: torch.Tensor, channel: StepChannel | None, checks: bool) -> torch.Tensor:
        """``out_TH`` (the layer's output), its backward checked to start at this layer's position
        (one header exchange before the layer's backward exchanges), where ``checks`` asks for it."""
        if channel is None or not checks or not out_TH.requires_grad:
            return out_TH
        return BackwardHeader.apply(out_TH, channel, self.at(BACKWARD))
