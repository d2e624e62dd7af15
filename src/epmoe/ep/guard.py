"""The step guard: a clip that epmoe did not do, or replicas that drifted apart, raise at the next forward.

``torch.nn.utils.clip_grad_norm_`` (and what calls it: ``accelerator.clip_grad_norm_`` of an
accelerator not given to :func:`epmoe.prepare_accelerator`, a Trainer not given to
:func:`epmoe.prepare_trainer`) sees only this rank's experts: each rank computes its own norm, clips
by its own factor (or, where every rank's partial norm is below ``max_norm`` while the whole model's
is not, by none), the experts get the wrong factor and the replicated weights drift apart. Nothing
of epmoe runs between that clip and the optimizer step, so the guard looks at the next forward of
the model's first experts module (outside a backward), at two things, and sends both to every EP
peer inside that forward's counts exchange (:data:`VALUES` more values in a row that travels anyway: no
collective of its own):

* **expert gradients changed in place after their backward ended, by other than one factor on every
  rank.** At the end of each backward whose expert gradients epmoe finished, the guard keeps each
  expert ``.grad``, its version counter and a copy of 16 evenly spaced elements (held until that
  next forward, early in it: the peak of the step, at the end of the forward, is unchanged).
  :func:`epmoe.clip_grad_norm_` re-reads the versions after its own multiply. At the next forward
  each rank fits the one factor ``c`` that takes the recorded elements to the current ones (a
  gradient that is zeros by then, ``zero_grad(set_to_none=False)``, is not a change) and sends
  ``c`` with its verdict:

  - the same ``c != 1`` on every rank (a framework that divides every gradient by the global token
    count, or a clip that was given the whole model's norm): the step is the unsharded model's
    scaled the same way, and training goes on;
  - a different ``c`` on some rank (torch's clip, which sees only its rank's experts and clips by
    its own factor), or a change that is no single factor: every rank raises;
  - ``c == 1`` on every rank with versions that moved: torch's clip where no rank's own norm reached
    ``max_norm``, although the whole model's may have: every rank raises, since that cannot be told
    from a clip that was right not to clip.

  ``ExpertParallelConfig(check_steps=False)`` turns this check off (for a clip known to see the
  whole model's norm). It cannot see a foreign clip followed by ``zero_grad(set_to_none=False)``
  (the fingerprint below still sees its per-rank factors).
* **a fingerprint of the replicated parameters** (every plain, non-expert parameter of the model:
  DDP's replicas), recomputed only when their version counters moved (once per optimizer step): a
  hash of the bits of up to 64 evenly spaced elements of each. Ranks whose replicas differ raise,
  whatever made them differ.

Both run only once the model runs under a data-parallel wrapper (the gradient policy's ``wrapper``:
DDP, FSDP2, a prepared Trainer or accelerator), where replicas must agree and clipping is the usual
idiom. Each model's :class:`~epmoe.ep.model.EPModel` holds one guard and says when it checks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch
from torch import nn

from epmoe.ep.counts import GUARD

SAMPLE = 64  # elements of each replicated parameter in the fingerprint
SCALE_SAMPLE = 16  # elements of each expert gradient the factor is fitted on
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (odd: a bijection mod 2**64)

# The guard's values in the counts exchange: [verdict, factor (float64 bits), tolerance (float64 bits), fingerprint]
VALUES = GUARD
NO_EVIDENCE, UNCHANGED, SCALED, CHANGED = 0, 1, 2, 3  # verdicts on the expert gradients

FIX = (
    "clip with epmoe.clip_grad_norm_(model, max_norm) (the whole model's norm, every expert once); "
    "with accelerate call epmoe.prepare_accelerator(accelerator), with a transformers Trainer "
    "epmoe.prepare_trainer(trainer), with twinkle epmoe.prepare_twinkle(model), once, before training"
)
SAME_FACTOR = (
    "(a scale by the same factor on every rank, such as a division by the global token count, passes; "
    "ExpertParallelConfig(check_steps=False) turns this check off for a clip you know sees the whole model's norm)"
)


class StepGuard:
    """The guard of one model (held by its :class:`~epmoe.ep.model.EPModel`). ``is_expert``: whether
    a parameter is one of the model's expert parameters (the rest are the replicated ones)."""

    def __init__(self, is_expert: Callable[[torch.Tensor], bool]):
        self._is_expert = is_expert
        self._records: list[list] = []  # [grad, version at the end of its backward, its elements then]
        self._armed = False  # whether this backward's _record is queued
        self._versions: int | None = None  # the replicated parameters' version counters, summed
        self._fingerprint: torch.Tensor | None = None

    # ---- the backward side

    def arm(self, root: nn.Module) -> None:
        """Called while a backward finishes expert gradients: record them once it ends."""
        if self._armed:
            return
        self._armed = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._record(root))

    def _record(self, root: nn.Module) -> None:
        self._armed = False
        self._records = [
            [p.grad, p.grad._version, _spread(p.grad.detach(), SCALE_SAMPLE).to(torch.float64, copy=True)]
            for p in root.parameters()
            if p.grad is not None and self._is_expert(p)
        ]

    def bless(self) -> None:
        """epmoe's own clip changed the recorded gradients: that change is the right one."""
        for record in self._records:
            record[1] = record[0]._version
            record[2] = _spread(record[0].detach(), SCALE_SAMPLE).to(torch.float64, copy=True)

    # ---- the forward side

    def payload(self, root: nn.Module, device: torch.device) -> torch.Tensor:
        """``(VALUES,)`` int64 on ``device`` for the counts exchange: ``[verdict, factor, tolerance,
        fingerprint]`` (zeros: no check from this rank)."""
        if torch._C._current_graph_task_id() != -1:  # a forward recomputed inside the backward
            return torch.zeros(VALUES, dtype=torch.int64, device=device)
        records, self._records = self._records, []
        verdict, factor, tolerance = _scale_verdict(records, device)
        return torch.stack(
            [verdict, factor.view(torch.int64), tolerance.view(torch.int64), self.fingerprint(root, device)]
        )

    def fingerprint(self, root: nn.Module, device: torch.device) -> torch.Tensor:
        """A hash (0-d int64, never 0) of the replicated parameters' sampled bits, cached until one of
        them changes in place."""
        params = [p for p in root.parameters() if not self._is_expert(p) and _plain(p)]
        versions = sum(p._version for p in params) + len(params)
        if self._fingerprint is None or versions != self._versions or self._fingerprint.device != device:
            self._fingerprint = (
                _fingerprint(params, device) if params else torch.ones((), dtype=torch.int64, device=device)
            )
            self._versions = versions
        return self._fingerprint


@torch.no_grad()
def _scale_verdict(records: list[list], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(verdict, factor, tolerance)`` (0-d int64, float64, float64 on ``device``, no host read): the
    one factor ``c`` taking each recorded gradient's elements to its current ones, fitted by least
    squares over every gradient not zeroed since, and whether it fits every element to within
    ``tolerance`` (relative, from the gradients' dtypes)."""
    one = torch.ones((), dtype=torch.float64, device=device)
    if not records:
        return torch.zeros((), dtype=torch.int64, device=device), one, one
    before, after, moved = [], [], []
    for grad, version, sample in records:
        now = _spread(grad.detach(), SCALE_SAMPLE).to(device, torch.float64)
        zeroed = (now == 0).all()  # zeros now: zero_grad(set_to_none=False), not a change
        before.append(torch.where(zeroed, 0, sample.to(device)))
        after.append(now)
        if grad._version != version:
            moved.append(~zeroed)
    before, after = torch.cat(before), torch.cat(after)
    moved = torch.stack(moved).any() if moved else torch.zeros((), dtype=torch.bool, device=device)
    evidence = (before != 0).any()
    c = (after * before).sum() / (before * before).sum().clamp_min(torch.finfo(torch.float64).tiny)
    # an in-place scale rounds each element once (within eps/2); the fit and the ranks' fits agree within that
    tolerance = 4 * max(torch.finfo(grad.dtype).eps for grad, _, _ in records) * one
    misfit = ((after - c * before).abs() > tolerance * (c * before).abs()).any()
    verdict = torch.where(misfit, CHANGED, torch.where(moved, SCALED, UNCHANGED))
    verdict = torch.where(evidence, verdict, NO_EVIDENCE).to(torch.int64)
    return verdict, torch.where(evidence, c, one), tolerance


def check(received: list[list[int]], describe: str) -> None:
    """Raise on every rank if a peer saw expert gradients changed outside epmoe by other than one factor
    on every rank, or fingerprints differ. ``received``: each EP rank's :data:`VALUES` values (zeros: no
    check from that rank)."""
    verdicts = [values[0] for values in received]
    factors = {rank: _float(values[1]) for rank, values in enumerate(received) if values[0] in (UNCHANGED, SCALED)}
    tolerance = max((_float(values[2]) for values in received if values[0]), default=0.0)
    changed = [rank for rank, verdict in enumerate(verdicts) if verdict == CHANGED]
    what = None
    if changed:
        what = f"on EP rank(s) {changed}, by something that is no single factor"
    elif SCALED in verdicts and max(factors.values()) - min(factors.values()) > tolerance * max(
        map(abs, factors.values())
    ):
        shown = ", ".join(f"rank {rank}: {factor:.6g}" for rank, factor in factors.items())
        what = f"by a different factor on each rank ({shown}): a clip that saw only its own rank's experts"
    elif SCALED in verdicts and all(abs(factor - 1.0) <= tolerance for factor in factors.values()):
        what = (
            "by a multiply by 1.0 on every rank: what torch's clip does where no rank's own norm reached max_norm, "
            "although the whole model's may have"
        )
    if what is not None:
        raise RuntimeError(
            f"epmoe: at {describe}, the expert gradients of the last backward were changed in place by something "
            f"other than epmoe, {what} (torch.nn.utils.clip_grad_norm_, accelerator.clip_grad_norm_ of an "
            f"accelerator not given to epmoe.prepare_accelerator, a Trainer not given to epmoe.prepare_trainer, "
            f"or another in-place change). That clip sees only each rank's own experts: every rank clips by its own "
            f"factor and the step differs from the unsharded model's (replicated weights drift apart). Fix: {FIX} "
            f"{SAME_FACTOR}"
        )
    prints = {values[-1] for values in received if values[-1]}
    if len(prints) > 1:
        by_rank = [values[-1] for values in received]
        groups = sorted({tuple(r for r, v in enumerate(by_rank) if v == value) for value in prints})
        raise RuntimeError(
            f"epmoe: at {describe}, the replicated (non-expert) parameters differ between EP ranks (equal within "
            f"{groups}): the ranks no longer train one model. Usually the last optimizer step used gradients "
            f"clipped by a different factor on each rank, or updated on some ranks only. Fix: {FIX}"
        )


def _float(bits: int) -> float:
    """The float64 whose bits are the int64 ``bits`` (a value that travelled in the counts exchange)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _plain(p: torch.Tensor) -> bool:
    """A parameter replicated as a whole tensor (not an FSDP2 DTensor shard, not on the meta device)."""
    return type(p.data) is torch.Tensor and p.device.type != "meta"


def _spread(t: torch.Tensor, n: int) -> torch.Tensor:
    """Up to ``n`` elements of ``t``, evenly spaced over it (a view: no copy of ``t``)."""
    flat = t.reshape(-1)
    return flat[:: max(1, flat.numel() // n)][:n]


@torch.no_grad()
def _fingerprint(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    samples = torch.cat([_spread(p.detach(), SAMPLE).to(device=device, dtype=torch.float64) for p in params])
    bits = samples.view(torch.int64)  # float64 holds every bf16 / fp16 / fp32 value exactly
    mixed = bits * _MIX
    mixed = mixed ^ (mixed >> 29)
    weights = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=device)  # position matters
    total = (mixed * weights).sum()
    return torch.where(total == 0, torch.ones_like(total), total)
