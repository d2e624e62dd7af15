"""The grouped-matmul backends: which are registered, which one runs a call (and why each other
declines), and how a chosen one runs; the op that users call is :mod:`epmoe.gmm.op`.

Registry order is the order of preference: ``npu``, ``batched`` (which ``auto`` takes only where its
cost rule accepts the call's counts: small, even groups), ``torch``, then ``loop``, which always
accepts and stays last. :func:`select_backend` and :func:`choose_backend` pick one:
``$EPMOE_GMM_BACKEND``, else a named backend, else (``"auto"``) the first eligible one. The first time
an accelerated backend runs, one INFO line says so; the first time the choice falls back past
accelerated backends, one WARNING names each one that declined and why.

A caller that issues several grouped matmuls on the same weights (an experts module's up and down
projections, in forward and backward) holds one :class:`BackendChoice`: the registered backends
judge the family of calls together, once per device and dtype, and one backend runs them all; the
calls are judged again only where their :class:`Operands` differ from the ones judged.

Operands are validated (:func:`~epmoe.gmm.operands.check_operands`) as the backends are asked about
them, and counts are given to a backend as it takes them (:mod:`epmoe.gmm.operands`).
:func:`run_grouped_mm` and :func:`run_grouped_mm_backward` run a chosen backend: the one body of the
``epmoe::grouped_mm`` op and of the other ops that run grouped matmuls inside
(``epmoe::routed_mlp``, the fused ``alltoallv_gmm`` / ``gmm_alltoallv``), which call them with the
backend object they were given.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from epmoe import errors
from epmoe.gmm.backend import BackendStatus, GmmBackend
from epmoe.gmm.batched import BatchedBackend
from epmoe.gmm.loop import LoopBackend
from epmoe.gmm.npu import NpuBackend
from epmoe.gmm.operands import check_operands
from epmoe.gmm.torch_gmm import TorchBackend

logger = logging.getLogger(__name__)

ENV_BACKEND = "EPMOE_GMM_BACKEND"
PREFERRED = "prefer:"  # grouped_mm(backend="prefer:NAME"): NAME where it takes the call, else as "auto"
# the names a backend's multiplications carry in profiles, wherever they run (the grouped_mm ops, or
# inside epmoe::routed_mlp)
PROFILED_FORWARD, PROFILED_BACKWARD = "epmoe.gmm.forward", "epmoe.gmm.backward"

_registry: list[GmmBackend] = [NpuBackend(), BatchedBackend(), TorchBackend(), LoopBackend()]
_generation = itertools.count()  # changes with the registry: a BackendChoice's judgements are of one registry
_registry_version = next(_generation)


def register_gmm_backend(backend: GmmBackend, *, before: str | None = None) -> None:
    """Add ``backend`` to the registry (replacing one of the same name).

    It goes just before the backend named ``before``, by default just before ``loop``, which stays
    the last resort.
    """
    if not isinstance(backend, GmmBackend):
        raise TypeError(f"register_gmm_backend(backend): expected a GmmBackend, got {type(backend).__name__}")
    if not isinstance(backend.name, str) or not backend.name or backend.name == "auto":
        raise ValueError(f"register_gmm_backend(backend): invalid backend name {backend.name!r}")
    names = [b.name for b in _registry if b.name != backend.name]
    anchor = "loop" if before is None else before
    if anchor not in names:
        raise ValueError(f"register_gmm_backend(before): no backend named {anchor!r}; registered: {names}")
    _registry[:] = [b for b in _registry if b.name != backend.name]
    _registry.insert(names.index(anchor), backend)
    _registry_changed()


def unregister_gmm_backend(name: str) -> None:
    """Remove a backend added with :func:`register_gmm_backend` (``loop`` cannot be removed)."""
    if name == "loop":
        raise ValueError("unregister_gmm_backend(name): the loop backend cannot be removed")
    _registry[:] = [b for b in _registry if b.name != name]
    _registry_changed()


def _registry_changed() -> None:
    global _registry_version
    _registry_version = next(_generation)


def gmm_backends(
    x: torch.Tensor | None = None, weight: torch.Tensor | None = None, *, trans_weight: bool = False
) -> list[BackendStatus]:
    """Every registered backend, in order, with whether it would run ``grouped_mm(x, weight)``.

    Without ``x``/``weight`` a small fp32 problem on the CPU is assumed. Operands are validated and
    judged as ``grouped_mm`` judges them (``x`` made contiguous).
    """
    if (x is None) != (weight is None):
        raise ValueError("gmm_backends(x, weight): pass both or neither")
    if x is None:
        x, weight = torch.zeros(16, 16), torch.zeros(2, 16, 16)
    return _judge([(None, x, weight, trans_weight)], "gmm_backends")


def gmm_backends_for(calls: Mapping[str, tuple[torch.Tensor, torch.Tensor, bool]]) -> list[BackendStatus]:
    """Every registered backend, in order, with whether it would run *every* one of several calls.

    ``calls`` maps a label to one ``grouped_mm`` call's ``(x, weight, trans_weight)``. A backend is
    eligible only if it accepts all of them (with no calls, every backend is); its reason is that of
    the first call it declines, as ``"label: reason"``.
    """
    return _judge([(label, *call) for label, call in calls.items()], "gmm_backends_for")


def select_backend(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    trans_weight: bool = False,
    backend: str = "auto",
    counts: list[int] | None = None,
    backward: bool = True,
) -> GmmBackend:
    """The backend ``grouped_mm`` runs for these operands (raises if a named one declines).

    Validates the operands as ``grouped_mm`` does; ``$EPMOE_GMM_BACKEND``, when set, forces its backend
    over ``backend``. With ``counts`` (validated by ``grouped_mm``), ``auto`` may take a backend that
    wins only on some group sizes (``backward``: whether the call will be differentiated).
    """
    calls = [(None, x, weight, trans_weight)]
    named = os.environ.get(ENV_BACKEND, "").strip() or backend
    if isinstance(named, str) and named.startswith(PREFERRED):
        statuses = _judge(calls, "select_backend", only=named[len(PREFERRED) :])
        if statuses and statuses[0].eligible:  # the preferred backend takes these operands
            return choose_backend(statuses, backend=named, counts=counts, x=x, backward=backward)
        named = backend = "auto"  # it declines them (or is unknown): the usual choice
    only = named if isinstance(named, str) and named != "auto" else None  # a named backend: judge it alone
    return choose_backend(
        _judge(calls, "select_backend", only=only), backend=backend, counts=counts, x=x, backward=backward
    )


def choose_backend(
    statuses: Sequence[BackendStatus],
    *,
    backend: str = "auto",
    counts: list[int] | None = None,
    x: torch.Tensor | None = None,
    backward: bool = True,
) -> GmmBackend:
    """The registered backend to run, given each backend's status (from :func:`gmm_backends` or
    :func:`gmm_backends_for`).

    ``$EPMOE_GMM_BACKEND`` (when set), else ``backend`` names one, which must be eligible (else
    ``ValueError`` with its reason); ``"auto"`` takes the first eligible one, passing over a
    ``by_counts`` backend unless the call's ``counts`` (on ``x``'s device, differentiated if
    ``backward``) are in its winning region. Logs the first use of an
    accelerated backend (INFO) and the first fallback past accelerated backends (WARNING).
    """
    if not isinstance(backend, str):
        raise TypeError(f"grouped_mm(backend): expected a str, got {type(backend).__name__}")
    forced = os.environ.get(ENV_BACKEND, "").strip()
    name = forced or backend
    if name.startswith(PREFERRED):  # select_backend found the preferred one eligible
        name = name[len(PREFERRED) :]
    registered = {b.name: b for b in _registry}
    if name != "auto":
        if name not in registered:
            source = f"${ENV_BACKEND}" if forced else "backend"
            raise ValueError(f"grouped_mm({source}): unknown backend {name!r}; choose one of {['auto', *registered]}")
        status = next((s for s in statuses if s.name == name), None)
        if status is None or not status.eligible:
            reason = "no status given for it" if status is None else status.reason
            raise ValueError(f"grouped_mm(backend={name!r}): backend declines: {reason}")
        chosen = registered[name]
    else:
        chosen, declined = None, []
        for status in statuses:
            if not status.eligible:
                declined.append((status.name, status.reason))
                continue
            candidate = registered[status.name]
            if candidate.by_counts and (
                counts is None or candidate.counts_reason(counts, x, backward=backward) is not None
            ):
                continue  # it would run, but not faster here
            chosen = candidate
            break
        if chosen is None:
            raise RuntimeError(f"grouped_mm: every backend declined: {declined}")  # loop never declines
        if declined and not chosen.accelerated:
            _warn_fallback(chosen, declined)
    if chosen.accelerated:
        errors.log_once(
            logger, logging.INFO, ("gmm info", chosen.name), "epmoe grouped_mm: using the %r backend", chosen.name
        )
    return chosen


def _judge(
    calls: list[tuple[str | None, object, object, object]], caller: str, only: str | None = None
) -> list[BackendStatus]:
    """Each registered backend's status (``only``: that backend's alone) on every call ``(label, x,
    weight, trans_weight)``, validated first; ``x`` is judged contiguous, as
    :func:`~epmoe.gmm.op.grouped_mm` passes it to the backend."""
    judged = []
    for label, x, weight, trans_weight in calls:
        check_operands(x, weight, trans_weight, caller if label is None else f"{caller}[{label!r}]")
        judged.append((label, x.contiguous(), weight, trans_weight))
    statuses = []
    for candidate in _registry:
        if only is not None and candidate.name != only:
            continue
        reason = None
        for label, x, weight, trans_weight in judged:
            reason = candidate.ineligible_reason(x, weight, trans_weight=trans_weight)
            if reason is not None:
                reason = reason if label is None else f"{label}: {reason}"
                break
        statuses.append(BackendStatus(candidate.name, reason is None, reason))
    return statuses


@dataclass(frozen=True)
class Operands:
    """What a backend's eligibility reads from one grouped matmul ``x @ weight`` (``x`` as the op
    passes it, contiguous): two calls with equal ``Operands`` get the same answer from every built-in
    backend, and a registered backend must decide from these properties alone.

    The device and dtypes, ``trans_weight``, ``x``'s width and strides (not its row count), the
    weight's shape and strides, and whether each data pointer is a multiple of 16 bytes (meta
    tensors count as aligned).
    """

    device: torch.device
    dtype: torch.dtype
    weight_dtype: torch.dtype
    trans_weight: bool
    x_width: int
    x_stride: tuple[int, ...]
    x_aligned: bool
    weight_shape: tuple[int, ...]
    weight_stride: tuple[int, ...]
    weight_aligned: bool

    @classmethod
    def of(cls, x: torch.Tensor, weight: torch.Tensor, trans_weight: bool) -> Operands:
        x_aligned, weight_aligned = (t.device.type == "meta" or t.data_ptr() % 16 == 0 for t in (x, weight))
        return cls(
            x.device,
            x.dtype,
            weight.dtype,
            trans_weight,
            x.shape[-1],
            x.stride(),
            x_aligned,
            tuple(weight.shape),
            weight.stride(),
            weight_aligned,
        )


Call = tuple[torch.Tensor, torch.Tensor, bool]  # one grouped matmul's (x, weight, trans_weight)
_CHOICES: weakref.WeakValueDictionary[int, BackendChoice] = weakref.WeakValueDictionary()
_CHOICE_KEYS = itertools.count()


class BackendChoice:
    """The one grouped-matmul backend of a family of grouped matmuls (an experts module's up and
    down projections, forward and backward), chosen once per device and dtype.

    ``requested``: ``"auto"`` or a registered backend name (``ExpertParallelConfig.gmm_backend``).
    ``family()``: the family's forward calls by label, ``(x, weight, trans_weight)`` with ``x`` an
    empty ``(0, D)`` tensor like the real rows (contiguous, fresh) and the weights as they are now.

    :meth:`backend_for` judges the family with every registered backend the first time it is asked
    on a device and dtype (:func:`gmm_backends_for`: eligible only where every call is); each later
    question costs a comparison of :class:`Operands`: calls whose operands are the family's take
    the family's backend without asking any backend again. A call whose operands differ (another
    dtype or device, weights substituted with other strides or alignment, rows of another width,
    strides or alignment) is judged again, once per such operands, and a backend runs it only
    where the family's judgement accepted it too (one backend for the family wherever it can be);
    after the registry changes, the family is judged again. ``$EPMOE_GMM_BACKEND`` and, for
    ``"auto"``, a backend that wins only on some group sizes apply per call, from the judged
    statuses (no backend is asked). The backend of a forward runs its backward too, as in
    :func:`~epmoe.gmm.op.grouped_mm`.

    What is judged per call, then, is only what can change between calls: the ops that run the
    family (``epmoe::routed_mlp``) ask :meth:`backend_for_weights`, which keeps each answer by the
    registry's version, ``$EPMOE_GMM_BACKEND``, whether the call is differentiated and the weights'
    operands, and chooses again per call only where the group sizes may decide (``"auto"`` and a
    ``by_counts`` backend that takes some calls of this kind: ``batched`` in inference on the CPU).

    The ``epmoe::grouped_mm`` op finds a choice by :attr:`key` (custom ops take no Python objects).
    """

    def __init__(self, requested: str = "auto", family: Callable[[], Mapping[str, Call]] = dict):
        if not isinstance(requested, str):
            raise TypeError(f"BackendChoice(requested): expected a str, got {type(requested).__name__}")
        self.requested, self.family = requested, family
        self._judged: dict[tuple, tuple[list[BackendStatus], frozenset[Operands]]] = {}
        self._fixed: dict[tuple, GmmBackend] = {}  # backend_for_weights' answers that no counts change
        self.key = self._register()

    def _register(self) -> int:
        key = next(_CHOICE_KEYS)
        _CHOICES[key] = self
        return key

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy`` of a model) registers itself under its own key, and looks its
        answers up afresh (the kept ones would be copies of the registered backends)."""
        self.__dict__.update(state)
        self._fixed = {}
        self.key = self._register()

    def backend_for(
        self, calls: Sequence[Call], *, counts: list[int] | None = None, backward: bool = True
    ) -> GmmBackend:
        """The backend for ``calls`` (``(x, weight, trans_weight)`` each, on one device and dtype;
        ``counts``: the groups' rows where the caller has them on the host, ``backward``: whether the
        calls will be differentiated), judged as the class docstring says."""
        return choose_backend(
            self._statuses(calls), backend=self.requested, counts=counts, x=calls[0][0], backward=backward
        )

    def backend_for_weights(
        self,
        weights: Sequence[torch.Tensor],
        trans_weight: bool,
        *,
        counts: list[int] | None = None,
        backward: bool = True,
    ) -> GmmBackend:
        """:meth:`backend_for` the grouped matmuls on ``weights`` (each read with ``trans_weight``) on
        rows like the ones an op gathers (contiguous, fresh): what an op that runs the family's
        matmuls asks each time it runs. Its answer is kept per registry, ``$EPMOE_GMM_BACKEND``,
        ``backward`` and the weights' :class:`Operands`, so a later call with the same costs one
        dictionary lookup; where the counts may change the answer (``"auto"`` with a ``by_counts``
        backend that :meth:`~epmoe.gmm.backend.GmmBackend.calls_reason` leaves to the counts, such as
        ``batched`` in an undifferentiated call on the CPU, given host ``counts``), it is chosen again
        per call instead (without host counts ``auto`` passes such a backend over: kept too)."""
        key = (
            _registry_version,
            os.environ.get(ENV_BACKEND, ""),
            backward,
            trans_weight,
            counts is None,
            *((w.device, w.dtype, w.shape, w.stride(), w.is_meta or w.data_ptr() % 16 == 0) for w in weights),
        )
        chosen = self._fixed.get(key)
        if chosen is None:
            calls = [(w.new_empty(0, w.shape[2 if trans_weight else 1]), w, trans_weight) for w in weights]
            chosen = self.backend_for(calls, counts=counts, backward=backward)
            named = os.environ.get(ENV_BACKEND, "").strip() or self.requested
            if (
                named != "auto"
                or counts is None
                or all(b.calls_reason(calls[0][0], backward=backward) is not None for b in _registry if b.by_counts)
            ):
                self._fixed[key] = chosen
        return chosen

    def _statuses(self, calls: Sequence[Call]) -> list[BackendStatus]:
        """Every registered backend's status on ``calls``, judged as the class docstring says."""
        _, weight, _ = calls[0]
        family_key = (_registry_version, weight.device, weight.dtype)
        judged = self._judged.get(family_key)
        if judged is None:
            family = self.family()
            statuses = gmm_backends_for(family) if family else _judge([(None, *call) for call in calls], "grouped_mm")
            judged = (statuses, frozenset(Operands.of(*call) for call in (family or dict(enumerate(calls))).values()))
            self._judged[family_key] = judged
        statuses, operands = judged
        differ = {op: call for op, call in ((Operands.of(*call), call) for call in calls) if op not in operands}
        if differ:  # these calls are judged again (with the family's verdicts), once per such operands
            again_key = (family_key, frozenset(differ))
            again = self._judged.get(again_key)
            if again is None:
                again = self._judged[again_key] = (
                    _both(statuses, _judge([(None, *call) for call in differ.values()], "grouped_mm")),
                    operands,
                )
            statuses = again[0]
        return statuses


def _both(first: list[BackendStatus], second: list[BackendStatus]) -> list[BackendStatus]:
    """Each backend eligible only where it is in both lists (of one registry, in its order)."""
    return [BackendStatus(a.name, a.eligible and b.eligible, a.reason or b.reason) for a, b in zip(first, second)]


def choice_of(key: int) -> BackendChoice:
    """The live :class:`BackendChoice` with :attr:`~BackendChoice.key` ``key``."""
    return _CHOICES[key]


def _warn_fallback(backend: GmmBackend, declined: list[tuple[str, str]]) -> None:
    reasons = "; ".join(f"{name}: {reason}" for name, reason in declined)
    errors.log_once(
        logger,
        logging.WARNING,
        ("gmm warning", backend.name),
        "epmoe grouped_mm: falling back to the %r backend (%s)",
        backend.name,
        reasons,
    )


def run_grouped_mm(
    x_TD: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor, trans_weight: bool, backend: GmmBackend
) -> torch.Tensor:
    """``y_TN``: the one body of every grouped matmul epmoe runs (the ``epmoe::grouped_mm`` op, and
    the ops that run grouped matmuls inside): rows of group ``g`` of ``x_TD`` times ``weight[g]``
    (transposed with ``trans_weight``) on ``backend``, as it was chosen (not judged here).
    ``counts``: as the backend takes them (:func:`backend_counts`); operands validated."""
    if x_TD.shape[0] == 0:
        return x_TD.new_zeros(0, weight.shape[1 if trans_weight else 2])
    with torch.profiler.record_function(PROFILED_FORWARD):
        return backend.forward(x_TD.contiguous(), weight, counts, trans_weight)


def run_grouped_mm_backward(
    dy_TN: torch.Tensor,
    x_TD: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int] | torch.Tensor,
    trans_weight: bool,
    backend: GmmBackend,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx_TD, dW)`` of :func:`run_grouped_mm` on the same backend: ``dx = dy @ W^T`` per group and
    ``dW`` in the weight's layout (zero for an empty group); an empty tensor for a gradient not
    needed (``x_TD`` may be an empty ``(0, D)`` probe when only ``dx`` is)."""
    dx = dw = dy_TN.new_empty(0)
    if dy_TN.shape[0] == 0:
        dx_shape = (0, weight.shape[2 if trans_weight else 1])
        return (dy_TN.new_zeros(dx_shape) if need_dx else dx), (torch.zeros_like(weight) if need_dw else dw)
    dy_TN = dy_TN.contiguous()
    with torch.profiler.record_function(PROFILED_BACKWARD):
        if need_dx:
            dx = backend.forward(dy_TN, weight, counts, not trans_weight)
        if need_dw:
            dw = backend.grad_weight(x_TD.contiguous(), dy_TN, counts, trans_weight)
    return dx, dw
