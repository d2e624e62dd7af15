"""The public fused ops, ``alltoallv_gmm`` and ``gmm_alltoallv``: validation, agreement, then an implementation.

Everything a rank can check on its own is checked first and raises ``TypeError`` / ``ValueError``
naming the argument: shapes, dtypes, devices, count lengths (``W * e``), signs and sums. Then (unless
``check=False``) the ranks agree, in one agreement step on a step channel
(:meth:`~epmoe.comm.steps.StepChannel.agree`), each rank's row::

    [header | dtype | exchanged width | rounds | e | len(send) | len(recv) | impl        must match
     | per peer r: rows sent to r, hash of those counts | per source s: rows expected, hash ]

so that what only the group can know (the exchanged rows' dtype and width, the rounds, whether
``recv_counts`` match the peers' ``send_counts``) and a peer's own bad arguments raise ``ValueError`` on
every rank, where mismatched collectives would abort a process or move wrong rows. Counts
straight from :func:`epmoe.exchange_counts` agree by construction: ``check=False`` skips the step.

The options both ops take:

* ``group``: the expert-parallel process group (``None``: the default group, or a group of one when
  ``torch.distributed`` is not initialised).
* ``shared_x``, ``shared_weight``: the shared expert, ``(BS, H2)`` and ``(H2, N2)`` (``(N2, H2)`` with
  ``trans_shared_weight``), computed in a gap of the communication.
* ``num_chunks``: pipelining rounds over local-expert ranges (int >= 1, clamped to ``e``, or
  ``"auto"``); the same on every rank; results do not depend on it.
* ``impl``: ``"auto"`` (``npu_fused`` where eligible, else ``pipelined``), ``"npu_fused"``,
  ``"pipelined"`` or ``"reference"``.
* ``gmm_backend``: the grouped-matmul backend: ``"auto"`` or a registered name (see
  :func:`epmoe.grouped_mm`), chosen once for every grouped matmul of the call, forward and backward,
  on the rows it multiplies (fresh, contiguous) and ``weight``; or a :class:`~epmoe.gmm.GmmBackend`
  the caller chose (run as given).
* ``check``: agree with the peers first (above; one small collective). Unsafe to turn off unless the
  counts come straight from :func:`epmoe.exchange_counts` and every rank passes the same dtype, width
  and ``num_chunks``: a mismatch then aborts a process or moves wrong rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from epmoe import errors, platform
from epmoe.comm.fused import reference
from epmoe.comm.fused.autograd import AlltoallvGmm, Call, GmmAlltoallv
from epmoe.comm.layout import RowLayout, round_bounds
from epmoe.comm.steps import AGREE, MODEL_WIDE, Position, StepChannel, dtype_code, dtype_name, world_size
from epmoe.gmm.backend import GmmBackend
from epmoe.gmm.operands import check_operands
from epmoe.gmm.registry import select_backend

IMPLS = ("auto", "npu_fused", "pipelined", "reference")
# num_chunks="auto": measured on 2 gloo ranks of a 2-core CPU (benchmarks/fused_cpu.md), rounds do
# not pay off there; on accelerators two rounds is an unmeasured default until the NCCL/HCCL rows
# of that benchmark are filled in.
AUTO_CHUNKS_CPU = 1
AUTO_CHUNKS_ACCELERATOR = 2


def alltoallv_gmm(
    x: torch.Tensor,
    weight: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    trans_weight: bool = False,
    shared_x: torch.Tensor | None = None,
    shared_weight: torch.Tensor | None = None,
    trans_shared_weight: bool = False,
    return_permuted: bool = False,
    num_chunks: int | str = 1,
    impl: str = "auto",
    gmm_backend: str | GmmBackend = "auto",
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Dispatch: all-to-all-v, permute to expert-major, grouped matmul (``torch_npu.npu_alltoallv_gmm``).

    ``W`` ranks in ``group``, ``e = weight.shape[0]`` local experts per rank, global expert ``r*e + j``.

    Args:
        x: ``(sum(send_counts), H1)`` rows rank-major: sorted by destination rank, then local expert.
        weight: ``(e, H1, N1)``, or ``(e, N1, H1)`` with ``trans_weight``: this rank's experts.
        send_counts: ``W*e`` ints; ``send_counts[r*e + j]`` rows of ``x`` go to rank ``r``'s expert ``j``.
        recv_counts: ``W*e`` ints; ``recv_counts[s*e + j]`` rows come from rank ``s`` for local expert ``j``.
        return_permuted: also return the received rows in expert-major order.
        group, shared_x, shared_weight, trans_shared_weight, num_chunks, impl, gmm_backend, check: the
            options both ops take (see the module docstring); the shared expert is computed while the
            first round is in flight.

    Returns:
        ``(y, shared_y, permuted)``: ``y`` ``(sum(recv_counts), N1)`` expert-major (sorted by local
        expert, then source rank); ``shared_y`` ``(BS, N2)`` or ``None``; ``permuted``
        ``(sum(recv_counts), H1)`` expert-major, or ``None``. Differentiable in every tensor input.
    """
    call, shared = _prepare(
        "alltoallv_gmm",
        x,
        weight,
        send_counts,
        recv_counts,
        group,
        trans_weight,
        shared_x,
        shared_weight,
        trans_shared_weight,
        return_permuted,
        num_chunks,
        impl,
        gmm_backend,
        check,
    )
    if impl == "reference":
        return _reference_dispatch(call, shared, x, weight, trans_weight, group, return_permuted)
    return AlltoallvGmm.apply(x, weight, shared_x, shared_weight, call)


def _reference_dispatch(call: Call, shared, x, weight, trans_weight: bool, group, return_permuted: bool):
    """``alltoallv_gmm(impl="reference")``: the plain collectives and autograd, one round."""
    return reference.dispatch(
        call.plan,
        x,
        weight,
        trans_weight,
        group,
        shared=shared,
        return_permuted=return_permuted,
        gmm_backend=call.gmm_backend.name,
    )


def gmm_alltoallv(
    x: torch.Tensor,
    weight: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    trans_weight: bool = False,
    shared_x: torch.Tensor | None = None,
    shared_weight: torch.Tensor | None = None,
    trans_shared_weight: bool = False,
    num_chunks: int | str = 1,
    impl: str = "auto",
    gmm_backend: str | GmmBackend = "auto",
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine: grouped matmul, unpermute, all-to-all-v back (``torch_npu.npu_gmm_alltoallv``).

    The mirror of :func:`alltoallv_gmm`; call it with that op's counts swapped.

    Args:
        x: ``(sum(send_counts), H1)`` rows expert-major (local expert, then source rank), e.g. the
            dispatch's ``y`` after the activation.
        weight: ``(e, H1, N1)``, or ``(e, N1, H1)`` with ``trans_weight``.
        send_counts: ``W*e`` ints; ``send_counts[s*e + j]`` rows of local expert ``j`` go back to
            rank ``s`` (the dispatch's ``recv_counts``).
        recv_counts: ``W*e`` ints; ``recv_counts[r*e + j]`` rows come back from rank ``r``'s expert
            ``j`` (the dispatch's ``send_counts``).
        group, shared_x, shared_weight, trans_shared_weight, num_chunks, impl, gmm_backend, check: the
            options both ops take (see the module docstring); the shared expert is computed last,
            hiding the last round.

    Returns:
        ``(y, shared_y)``: ``y`` ``(sum(recv_counts), N1)`` rank-major, i.e. in the order of the
        dispatch's input; ``shared_y`` ``(BS, N2)`` or ``None``. Differentiable in every tensor input.
    """
    call, shared = _prepare(
        "gmm_alltoallv",
        x,
        weight,
        send_counts,
        recv_counts,
        group,
        trans_weight,
        shared_x,
        shared_weight,
        trans_shared_weight,
        False,
        num_chunks,
        impl,
        gmm_backend,
        check,
    )
    if impl == "reference":
        return reference.combine(
            call.plan, x, weight, trans_weight, group, shared=shared, gmm_backend=call.gmm_backend.name
        )
    return GmmAlltoallv.apply(x, weight, shared_x, shared_weight, call)


def _prepare(
    op,
    x,
    weight,
    send_counts,
    recv_counts,
    group,
    trans_weight,
    shared_x,
    shared_weight,
    trans_shared_weight,
    return_permuted,
    num_chunks,
    impl,
    gmm_backend,
    check,
) -> tuple[Call, tuple[torch.Tensor, torch.Tensor, bool] | None]:
    """Validate every argument, agree with the peers unless ``check`` is off, build the :class:`Call`."""
    ep_size = world_size(group, op)
    try:
        if not isinstance(check, bool):
            raise TypeError(f"{op}(check): expected a bool, got {type(check).__name__}")
        call, shared = _validate(
            op,
            x,
            weight,
            send_counts,
            recv_counts,
            group,
            ep_size,
            trans_weight,
            shared_x,
            shared_weight,
            trans_shared_weight,
            return_permuted,
            num_chunks,
            impl,
            gmm_backend,
        )
    except (TypeError, ValueError):
        if check is not False and ep_size > 1:  # the peers must not wait for this rank: tell them
            try:
                _agree(op, group, ep_size, None, None)
            except ValueError:
                pass  # the peers raise; this rank raises its own error
        raise
    if check and ep_size > 1:
        width = x.shape[1] if op == "alltoallv_gmm" else weight.shape[1 if trans_weight else 2]
        _agree(op, group, ep_size, call, x, width)
    return call, shared


def _validate(
    op,
    x,
    weight,
    send_counts,
    recv_counts,
    group,
    ep_size,
    trans_weight,
    shared_x,
    shared_weight,
    trans_shared_weight,
    return_permuted,
    num_chunks,
    impl,
    gmm_backend,
) -> tuple[Call, tuple[torch.Tensor, torch.Tensor, bool] | None]:
    """Every check a rank can make on its own (no collective)."""
    for name, flag in (
        ("trans_weight", trans_weight),
        ("trans_shared_weight", trans_shared_weight),
        ("return_permuted", return_permuted),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}({name}): expected a bool, got {type(flag).__name__}")
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}(impl): expected one of {IMPLS}, got {impl!r}")
    if not isinstance(gmm_backend, (str, GmmBackend)):
        raise TypeError(f"{op}(gmm_backend): expected a str or a GmmBackend, got {type(gmm_backend).__name__}")
    _check_routed(op, x, weight, trans_weight)
    if isinstance(gmm_backend, str):  # chosen once, for the grouped matmuls of the forward and the backward
        rows = x.new_empty(0, x.shape[1]) if op == "alltoallv_gmm" else x  # the dispatch multiplies received rows
        gmm_backend = select_backend(rows, weight, trans_weight=trans_weight, backend=gmm_backend)
    shared = _check_shared(op, x, shared_x, shared_weight, trans_shared_weight)
    e = weight.shape[0]
    send = _counts(op, "send_counts", send_counts, ep_size, e)
    recv = _counts(op, "recv_counts", recv_counts, ep_size, e)
    if sum(send) != x.shape[0]:
        raise ValueError(f"{op}(send_counts): counts sum to {sum(send)}, but x has {x.shape[0]} rows")
    if ep_size == 1 and send != recv:
        raise ValueError(f"{op}(recv_counts): {recv} differs from send_counts {send} on a group of one rank")
    chunks = _num_chunks(op, num_chunks, x, e)
    rank_major, expert_major = (send, recv) if op == "alltoallv_gmm" else (recv, send)
    plan = RowLayout(ep_size, e, tuple(rank_major), tuple(expert_major), tuple(round_bounds(e, chunks)))
    call = Call(op, plan, group, trans_weight, trans_shared_weight, return_permuted, impl, gmm_backend)
    return call, shared


_HASH_MOD = (1 << 61) - 1


def _counts_hash(counts: Sequence[int]) -> int:
    h = 0
    for c in counts:
        h = (h * 1_000_003 + c + 1) % _HASH_MOD
    return h


def _agree(op: str, group, ep_size: int, call: Call | None, x: torch.Tensor | None, exchanged_width: int = 0) -> None:
    """The agreement step (see the module docstring): ``ValueError`` on every rank unless every rank's
    arguments were valid (``call`` is ``None`` on a rank whose were not) and fit together;
    ``exchanged_width``: the columns of the rows that travel."""
    fields, blocks = _agreement_row(op, ep_size, call, x, exchanged_width)

    def show(name: str, value: int) -> object:
        return dtype_name(value) if name == "dtype" else IMPLS[value] if name == "impl" else value

    channel = StepChannel(group, len(fields) + len(blocks))
    device = x.device if x is not None else platform.group_device(group)  # a rank whose arguments failed
    rows = channel.agree(
        Position(MODEL_WIDE, AGREE, 0), device, fields, blocks, failed=call is None, caller=op, show=show
    )
    if call is not None:
        _check_counts_match(op, ep_size, channel.rank, [row[len(fields) :] for row in rows])


def _agreement_row(
    op: str, ep_size: int, call: Call | None, x: torch.Tensor | None, exchanged_width: int
) -> tuple[list[tuple[str, int]], list[int]]:
    """``(fields, blocks)`` this rank shows its peers: the fields every rank must share, then per peer
    ``r`` the rows it sends ``r`` and their hash, per source ``s`` the rows it expects and their hash
    (zeros where ``call`` is ``None``: its arguments failed)."""
    names = (
        "dtype",
        "exchanged row width",
        "number of rounds (num_chunks clamped to e)",
        "local experts e",
        "len(send_counts)",
        "len(recv_counts)",
        "impl",
    )
    blocks = [0] * (4 * ep_size)
    if call is None:
        return [(name, 0) for name in names], blocks
    plan, e = call.plan, call.plan.e
    send, recv = (
        (plan.counts_rank_major_WE, plan.counts_expert_major_WE)
        if op == "alltoallv_gmm"
        else (plan.counts_expert_major_WE, plan.counts_rank_major_WE)
    )
    values = (dtype_code(x.dtype), exchanged_width, len(plan.rounds), e, len(send), len(recv), IMPLS.index(call.impl))
    for r in range(ep_size):
        block_sent, block_expected = send[r * e : (r + 1) * e], recv[r * e : (r + 1) * e]
        blocks[2 * r : 2 * r + 2] = [sum(block_sent), _counts_hash(block_sent)]
        blocks[2 * ep_size + 2 * r : 2 * ep_size + 2 * r + 2] = [sum(block_expected), _counts_hash(block_expected)]
    return list(zip(names, values)), blocks


def _check_counts_match(op: str, ep_size: int, me: int, headers: list[list[int]]) -> None:
    """``ValueError`` unless what each rank sends each peer is what that peer expects from it
    (``headers``: every rank's blocks, from :func:`_agreement_row`)."""
    for r, receiver in enumerate(headers):
        for s, sender in enumerate(headers):
            sent = sender[2 * r : 2 * r + 2]
            expected = receiver[2 * ep_size + 2 * s : 2 * ep_size + 2 * s + 2]
            if sent != expected:
                how = (
                    f"expects {expected[0]} rows from rank {s}, which sends {sent[0]}"
                    if sent[0] != expected[0]
                    else f"expects from rank {s} the {sent[0]} rows it sends, split differently over its experts"
                )
                raise ValueError(
                    f"{op}(recv_counts): rank {r} {how} (send_counts[{r}*e:({r}+1)*e] on rank {s} must equal "
                    f"recv_counts[{s}*e:({s}+1)*e] on rank {r}; epmoe.exchange_counts builds matching counts; "
                    f"this is rank {me})"
                )


def _check_routed(op: str, x: Any, weight: Any, trans_weight: bool) -> None:
    check_operands(x, weight, trans_weight, op)
    if x.device.type == "meta":
        raise ValueError(f"{op}(x): on the meta device: there are no rows to exchange")
    if weight.shape[0] == 0:
        raise ValueError(f"{op}(weight): expected at least one local expert, got shape {tuple(weight.shape)}")


def _check_shared(op, x, shared_x, shared_weight, trans) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    if shared_x is None and shared_weight is None:
        return None
    if shared_x is None or shared_weight is None:
        raise ValueError(f"{op}(shared_x, shared_weight): pass both or neither")
    for name, t in (("shared_x", shared_x), ("shared_weight", shared_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}({name}): expected a Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}({name}): expected a 2-D tensor, got shape {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise ValueError(f"{op}({name}): dtype {t.dtype} does not match x's {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{op}({name}): on {t.device}, x is on {x.device}")
    k = shared_weight.shape[1] if trans else shared_weight.shape[0]
    if k != shared_x.shape[1]:
        layout = "(N2, H2)" if trans else "(H2, N2)"
        raise ValueError(
            f"{op}(shared_weight): shape {tuple(shared_weight.shape)} read as {layout} has H2={k}, "
            f"but shared_x has {shared_x.shape[1]} columns"
        )
    return shared_x, shared_weight, trans


def _counts(op: str, name: str, counts: Any, ep_size: int, e: int) -> list[int]:
    """``counts`` as a list of ``ep_size * e`` non-negative ints; never reads a device tensor."""
    values = errors.int_list(f"{op}({name})", counts, host_only=True)
    if len(values) != ep_size * e:
        raise ValueError(
            f"{op}({name}): expected W*e = {ep_size}*{e} = {ep_size * e} counts ({ep_size} ranks in the group, "
            f"e = weight.shape[0] = {e} local experts), got {len(values)}"
        )
    if any(c < 0 for c in values):
        raise ValueError(f"{op}({name}): counts must be non-negative, got {errors.negatives(values)}")
    return values


def _num_chunks(op: str, num_chunks: Any, x: torch.Tensor, e: int) -> int:
    if num_chunks == "auto":
        return AUTO_CHUNKS_CPU if platform.device_type(x) == "cpu" else min(e, AUTO_CHUNKS_ACCELERATOR)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"{op}(num_chunks): expected an int >= 1 or 'auto', got {num_chunks!r}")
    return min(num_chunks, e)
