"""The fused ops' engines, registered like grouped-matmul backends: each says why it declines a run.

    ENGINES (order of preference)     ineligible_reason(call, x, weight, trans_weight, unsupported)
      npu_fused   torch_npu kernels   a reason unless every constraint holds on every rank (collective)
      pipelined   rounds + async a2a  never declines

:func:`choose_engine` picks, for one run (a forward, or a backward), the first engine that accepts
it for ``impl="auto"``, the named one otherwise (``impl="npu_fused"`` in a forward raises on every
rank where it declines; a backward falls back to ``pipelined``). ``impl="reference"`` is not an
engine: it is plain autograd (:mod:`~epmoe.comm.fused.reference`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from epmoe import errors
from epmoe.comm.fused import npu, pipelined

logger = logging.getLogger(__name__)


class FusedEngine(Protocol):
    """What :class:`~epmoe.comm.fused.autograd.AlltoallvGmm` / ``GmmAlltoallv`` run: ``dispatch`` and
    ``combine`` with the signatures of :mod:`~epmoe.comm.fused.pipelined`, returning its ``Result``."""

    name: str

    def ineligible_reason(self, call: Any, x: torch.Tensor, weight: torch.Tensor, trans_weight: bool, *,
                          unsupported: str | None = None) -> str | None:
        """Why this engine cannot run this call (the same answer on every rank), or ``None``."""

    def dispatch(self, plan, x, weight, trans_weight, group, **options) -> pipelined.Result: ...

    def combine(self, plan, x, weight, trans_weight, group, **options) -> pipelined.Result: ...


class NpuFusedEngine:
    """The ``torch_npu`` fused kernels (:mod:`~epmoe.comm.fused.npu`)."""

    name = "npu_fused"
    dispatch = staticmethod(npu.dispatch)
    combine = staticmethod(npu.combine)

    def ineligible_reason(self, call, x, weight, trans_weight, *, unsupported=None):
        return npu.decide(call.plan, x, weight, trans_weight, call.group, unsupported=unsupported)


class PipelinedEngine:
    """Rounds over local-expert ranges, async all-to-all beside the grouped matmuls (:mod:`~epmoe.comm.fused.pipelined`)."""

    name = "pipelined"
    dispatch = staticmethod(pipelined.dispatch)
    combine = staticmethod(pipelined.combine)

    def ineligible_reason(self, call, x, weight, trans_weight, *, unsupported=None):
        return None


ENGINES: tuple[FusedEngine, ...] = (NpuFusedEngine(), PipelinedEngine())


def choose_engine(call: Any, x: torch.Tensor, weight: torch.Tensor, trans_weight: bool, *, strict: bool,
                  unsupported: str | None = None) -> FusedEngine:
    """The engine for one run, the same on all ranks (see the module docstring); ``strict``: a
    forward, where a named ``impl`` that declines raises ``ValueError``."""
    if call.impl == "auto":
        candidates = ENGINES
    else:  # the named engine; a backward falls back to the last, which never declines
        candidates = tuple(e for e in ENGINES if e.name == call.impl) + (() if strict else ENGINES[-1:])
    declined = []
    for engine in candidates:
        reason = engine.ineligible_reason(call, x, weight, trans_weight, unsupported=unsupported)
        if reason is None:
            why = "; ".join(f"{name} declined: {r}" for name, r in declined) or None
            errors.log_once(logger, logging.INFO, (call.op, engine.name, why), "epmoe %s: %s path%s", call.op,
                            engine.name, f" ({why})" if why else "")
            return engine
        if strict and call.impl != "auto":
            raise ValueError(f"{call.op}(impl={call.impl!r}): the {engine.name} engine cannot run this call: {reason}")
        declined.append((engine.name, reason))
    raise AssertionError(f"epmoe: no fused engine accepted {call.op} (the last one never declines)")
