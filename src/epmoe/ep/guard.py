"""The step guard: a clip that epmoe did not do, or replicas that drifted apart, raise at the next forward.

``torch.nn.utils.clip_grad_norm_`` (and what calls it: ``accelerator.clip_grad_norm_`` of an
accelerator not given to :func:`epmoe.prepare_accelerator`, a Trainer not given to
:func:`epmoe.prepare_trainer`) sees only this rank's experts: each rank computes its own norm, clips
by its own factor (or, where every rank's partial norm is below ``max_norm`` while the whole model's
is not, by none), the experts get the wrong factor and the replicated weights drift apart. Nothing
of epmoe runs between that clip and the optimizer step, so the guard looks at the next forward of
the model's first experts module (outside a backward), at two things, and sends both to every EP
peer inside that forward's counts exchange (two more values in a row that travels anyway: no
collective of its own):

* **expert gradients changed in place after their backward ended.** At the end of each backward
  whose expert gradients epmoe finished, the guard keeps each expert ``.grad`` and its version
  counter (held until that next forward, early in it: the peak of the step, at the end of the
  forward, is unchanged). :func:`epmoe.clip_grad_norm_` re-reads the versions after its own
  multiply. Any other in-place change (torch's clip always multiplies, by 1.0 where it does not
  clip) leaves a version that moved; a gradient that is zeros by then (``zero_grad(set_to_none=False)``,
  judged on 16 evenly spaced elements) is not a change. This fires at the forward after the first
  step clipped without epmoe, whatever the norms were; it cannot see a foreign clip followed by
  ``zero_grad(set_to_none=False)`` (the fingerprint below still sees its per-rank factors).
* **a fingerprint of the replicated parameters** (every plain, non-expert parameter of the model:
  DDP's replicas), recomputed only when their version counters moved (once per optimizer step): a
  hash of the bits of up to 64 evenly spaced elements of each. Ranks whose replicas differ raise,
  whatever made them differ.

Both run only once the model runs under a data-parallel wrapper (the gradient policy's ``wrapper``:
DDP, FSDP2, a prepared Trainer or accelerator), where replicas must agree and clipping is the usual
idiom. Each model's :class:`~epmoe.ep.model.EPModel` holds one guard and says when it checks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SAMPLE = 64  # elements of each replicated parameter in the fingerprint
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (odd: a bijection mod 2**64)

FIX = (
    "clip with epmoe.clip_grad_norm_(model, max_norm) (the whole model's norm, every expert once); "
    "with accelerate call epmoe.prepare_accelerator(accelerator), with a transformers Trainer "
    "epmoe.prepare_trainer(trainer), once, before training"
)


class StepGuard:
    """The guard of one model (held by its :class:`~epmoe.ep.model.EPModel`). ``is_expert``: whether
    a parameter is one of the model's expert parameters (the rest are the replicated ones)."""

    def __init__(self, is_expert: Callable[[torch.Tensor], bool]):
        self._is_expert = is_expert
        self._records: list[list] = []  # [grad, version at the end of its backward]
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
            [p.grad, p.grad._version] for p in root.parameters() if p.grad is not None and self._is_expert(p)
        ]

    def bless(self) -> None:
        """epmoe's own clip changed the recorded gradients: that change is the right one."""
        for record in self._records:
            record[1] = record[0]._version

    # ---- the forward side

    def payload(self, root: nn.Module, device: torch.device) -> torch.Tensor:
        """``(2,)`` int64 on ``device``: ``[changed, fingerprint]`` for the counts exchange (zeros: no
        check from this rank)."""
        if torch._C._current_graph_task_id() != -1:  # a forward recomputed inside the backward
            return torch.zeros(2, dtype=torch.int64, device=device)
        records, self._records = self._records, []
        # changed since: its version moved and it is not zeros (a zero_grad(set_to_none=False))
        moved = [
            _spread(grad.detach(), 16).ne(0).any().to(device) for grad, version in records if grad._version != version
        ]
        changed = (
            torch.stack(moved).any().to(torch.int64) if moved else torch.zeros((), dtype=torch.int64, device=device)
        )
        return torch.stack([changed, self.fingerprint(root, device)])

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


def check(received: list[list[int]], describe: str) -> None:
    """Raise on every rank if a peer saw expert gradients changed outside epmoe, or fingerprints differ.
    ``received``: each EP rank's ``[changed, fingerprint]`` (``[0, 0]``: no check from that rank)."""
    changed = [rank for rank, (flag, _) in enumerate(received) if flag]
    if changed:
        raise RuntimeError(
            f"epmoe: at {describe}, the expert gradients of the last backward were changed in place by something "
            f"other than epmoe on EP rank(s) {changed} (torch.nn.utils.clip_grad_norm_, accelerator.clip_grad_norm_ "
            f"of an accelerator not given to epmoe.prepare_accelerator, a Trainer not given to epmoe.prepare_trainer, "
            f"or another in-place change). That clip sees only each rank's own experts: every rank clips by its own "
            f"factor and the step differs from the unsharded model's (replicated weights drift apart). Fix: {FIX}"
        )
    prints = {value for _, value in received if value}
    if len(prints) > 1:
        by_rank = [value for _, value in received]
        groups = sorted({tuple(r for r, v in enumerate(by_rank) if v == value) for value in prints})
        raise RuntimeError(
            f"epmoe: at {describe}, the replicated (non-expert) parameters differ between EP ranks (equal within "
            f"{groups}): the ranks no longer train one model. Usually the last optimizer step used gradients "
            f"clipped by a different factor on each rank, or updated on some ranks only. Fix: {FIX}"
        )


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
