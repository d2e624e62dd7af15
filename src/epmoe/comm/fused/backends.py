"""The fused ops' backends, registered like grouped-matmul backends: each says why it declines a run.

    BACKENDS (order of preference)    ineligible_reason(call, x, weight, trans_weight, unsupported)
      npu_fused   torch_npu kernels   a reason unless every constraint holds on every rank (collective)
      pipelined   rounds + async a2a  never declines

:func:`choose_fused_backend` picks, for one run (a forward, or a backward), the first backend that accepts
it for ``impl="auto"``, the named one otherwise (``impl="npu_fused"`` in a forward raises on every
rank where it declines; a backward falls back to ``pipelined``). ``impl="reference"`` is not a
backend: it is plain autograd (:mod:`~epmoe.comm.fused.reference`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from epmoe import errors
from epmoe.comm.fused import npu, pipelined

logger = logging.getLogger(__name__)


class FusedBackend(Protocol):
    """What :class:`~epmoe.comm.fused.autograd.AlltoallvGmm` / ``GmmAlltoallv`` run: ``dispatch`` and
    ``combine`` with the signatures of :mod:`~epmoe.comm.fused.pipelined` (a ``Run``, the input rows,
    the op's own options), returning its ``Result``."""

    name: str

    def ineligible_reason(
        self, call: Any, x: torch.Tensor, weight: torch.Tensor, trans_weight: bool, *, unsupported: str | None = None
    ) -> str | None:
        """Why this backend cannot run this call (the same answer on every rank), or ``None``."""

    def dispatch(self, run: pipelined.Run, x_rank_major: torch.Tensor, **options) -> pipelined.Result: ...

    def combine(self, run: pipelined.Run, x_expert_major: torch.Tensor, **options) -> pipelined.Result: ...


class NpuFusedBackend:
    """The ``torch_npu`` fused kernels (:mod:`~epmoe.comm.fused.npu`)."""

    name = "npu_fused"
    dispatch = staticmethod(npu.dispatch)
    combine = staticmethod(npu.combine)

    def ineligible_reason(self, call, x, weight, trans_weight, *, unsupported=None):
        return npu.decide(call.plan, x, weight, trans_weight, call.group, unsupported=unsupported)


class PipelinedBackend:
    """Rounds over local-expert ranges, async all-to-all beside the grouped matmuls (:mod:`~epmoe.comm.fused.pipelined`)."""

    name = "pipelined"
    dispatch = staticmethod(pipelined.dispatch)
    combine = staticmethod(pipelined.combine)

    def ineligible_reason(self, call, x, weight, trans_weight, *, unsupported=None):
        return None


BACKENDS: tuple[FusedBackend, ...] = (NpuFusedBackend(), PipelinedBackend())


def choose_fused_backend(
    call: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    trans_weight: bool,
    *,
    strict: bool,
    unsupported: str | None = None,
) -> FusedBackend:
    """The backend for one run, the same on all ranks (see the module docstring); ``strict``: a
    forward, where a named ``impl`` that declines raises ``ValueError``."""
    if call.impl == "auto":
        candidates = BACKENDS
    else:  # the named backend; a backward falls back to the last, which never declines
        candidates = tuple(e for e in BACKENDS if e.name == call.impl) + (() if strict else BACKENDS[-1:])
    declined = []
    for backend in candidates:
        reason = backend.ineligible_reason(call, x, weight, trans_weight, unsupported=unsupported)
        if reason is None:
            why = "; ".join(f"{name} declined: {r}" for name, r in declined) or None
            errors.log_once(
                logger,
                logging.INFO,
                (call.op, backend.name, why),
                "epmoe %s: %s path%s",
                call.op,
                backend.name,
                f" ({why})" if why else "",
            )
            return backend
        if strict and call.impl != "auto":
            raise ValueError(
                f"{call.op}(impl={call.impl!r}): the {backend.name} backend cannot run this call: {reason}"
            )
        declined.append((backend.name, reason))
    raise AssertionError(f"epmoe: no fused backend accepted {call.op} (the last one never declines)")
