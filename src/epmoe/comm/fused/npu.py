"""The ``npu_fused`` implementation: ``torch_npu.npu_alltoallv_gmm`` / ``npu_gmm_alltoallv``.

Used only where every constraint of the vendor's documentation and of the kernel sources of
these ops holds::

    device        Atlas A3 (device name Ascend910_93xx), torch_npu installed, tensors on the NPU
    EP size       W in {8, 16, 32, 64}
    experts       e <= 32 local experts, e * W <= 256
    dtypes        float16 / bfloat16 (weights and shared expert in the same dtype)
    dims          input and output widths in (0, 65536)
    volume        for every peer p and for both count lists (sent and received):
                  sum(counts[p*e:(p+1)*e]) * input width * element size in [2 MiB, 100 MiB];
                  rows sent and received in (0, 52428800)

The volume depends on the step's counts, which differ between ranks, so the decision is made
identically on all ranks with one tiny all-reduce (MIN of "this rank is eligible"); otherwise some
ranks would enter the fused kernel and others the pipelined rounds, and all of them would hang.
The static conditions are the same on every rank and need no collective.

The ops have no autograd: epmoe's autograd wrapper gives each one the other as its backward (weight
transposed through the op's flag, counts swapped) and computes ``dW`` with the grouped-matmul
backend from ``permute_out`` (dispatch) or the saved input (combine), grouped by the received
per-expert counts. The fused shared expert is off by default (a kernel bug is reported by
MindSpeed); the shared expert then runs on a side stream beside the fused op. Set
``EPMOE_NPU_FUSE_SHARED_EXPERT=1`` to hand it to the kernel where its own limits hold.

Written from the vendor's documentation and kernel sources; tested against the CPU emulation in
``tests/support/npu_fused_emulation.py``, never on Ascend hardware.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from epmoe import platform
from epmoe.comm.fused.pipelined import Result, Run, grad_weight
from epmoe.comm.layout import RowLayout

A3_DEVICE_PREFIX = "Ascend910_93"
SUPPORTED_EP_SIZES = (8, 16, 32, 64)
MAX_LOCAL_EXPERTS = 32
MAX_GLOBAL_EXPERTS = 256
DTYPES = (torch.float16, torch.bfloat16)
DIM_LIMIT = 65536  # widths must be below this
ROWS_LIMIT = 52428800  # rows sent / received must be below this
MIN_PEER_BYTES = 2 * 2**20
MAX_PEER_BYTES = 100 * 2**20
MAX_SHARED_HIDDEN = 12288
SHARED_TOPK_RANGE = (2, 8)
ENV_FUSE_SHARED = "EPMOE_NPU_FUSE_SHARED_EXPERT"

_hcom_names: dict[Any, str] = {}
_side_streams: dict[str, Any] = {}


def device_reason(x: torch.Tensor) -> str | None:
    """Why the device rules the ops out (no torch_npu, not an NPU tensor, not an A3), or ``None``."""
    if platform.torch_npu() is None:
        return "torch_npu is not installed"
    kind = platform.device_type(x)
    if kind != "npu":
        return f"tensors are on {kind!r}, not an NPU"
    name = str(platform.device_module("npu").get_device_name(x.device.index))
    if not name.startswith(A3_DEVICE_PREFIX):
        return f"device {name!r} is not an Atlas A3 ({A3_DEVICE_PREFIX}xx) device"
    return None


def static_reason(x: torch.Tensor, weight: torch.Tensor, trans_weight: bool, ep_size: int, e: int) -> str | None:
    """Why conditions that are the same on every rank rule the ops out, or ``None``."""
    reason = device_reason(x)
    if reason is not None:
        return reason
    if ep_size not in SUPPORTED_EP_SIZES:
        return f"EP size {ep_size} is not one of {SUPPORTED_EP_SIZES}"
    if e > MAX_LOCAL_EXPERTS:
        return f"{e} local experts exceed {MAX_LOCAL_EXPERTS}"
    if e * ep_size > MAX_GLOBAL_EXPERTS:
        return f"e * W = {e * ep_size} global experts exceed {MAX_GLOBAL_EXPERTS}"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not float16 / bfloat16"
    out_width = weight.shape[1] if trans_weight else weight.shape[2]
    for name, width in (("input width", x.shape[1]), ("output width", out_width)):
        if not 0 < width < DIM_LIMIT:
            return f"{name} {width} is not in (0, {DIM_LIMIT})"
    return None


def volume_reason(plan: RowLayout, width: int, element_size: int) -> str | None:
    """Why this rank's counts rule the ops out (per-peer volume, row totals), or ``None``.

    Both lists are checked, each per peer, with the input width (also for the combine op, whose
    kernel counts its input width, not its output width).
    """
    for name, rows_W in (("rank-major", plan.rank_major_splits), ("expert-major", plan.expert_major_splits_W)):
        rows = sum(rows_W)
        if not 0 < rows < ROWS_LIMIT:
            return f"{rows} rows in the {name} counts are not in (0, {ROWS_LIMIT})"
        for peer, peer_rows in enumerate(rows_W):
            volume = peer_rows * width * element_size
            if not MIN_PEER_BYTES <= volume <= MAX_PEER_BYTES:
                return f"{name} volume with rank {peer} is {volume} B, outside [{MIN_PEER_BYTES}, {MAX_PEER_BYTES}] B"
    return None


def decide(
    plan: RowLayout,
    x: torch.Tensor,
    weight: torch.Tensor,
    trans_weight: bool,
    group: Any,
    *,
    unsupported: str | None = None,
) -> str | None:
    """``None`` when every rank runs the fused op for this call, else why not; the same on all ranks.

    No collective when a static condition fails (it fails on every rank); otherwise one all-reduce of
    one integer and one host read. ``unsupported`` is a local reason the caller already has.
    """
    reason = static_reason(x, weight, trans_weight, plan.ep_size, plan.e)
    if reason is not None:
        return reason
    local = unsupported or volume_reason(plan, x.shape[1], x.element_size())
    eligible = torch.tensor([0 if local else 1], dtype=torch.int32, device=x.device)
    dist.all_reduce(eligible, op=dist.ReduceOp.MIN, group=group)
    platform.synchronize(x.device)
    if local:
        return local
    if int(eligible.item()) == 0:
        return "another rank's counts are outside the op's limits"
    return None


def fuse_shared_reason(
    shared_x: torch.Tensor, shared_weight: torch.Tensor, trans: bool, rank_major_rows: int
) -> str | None:
    """Why the shared expert stays outside the kernel (the default), or ``None`` to fuse it."""
    if os.environ.get(ENV_FUSE_SHARED, "").strip() != "1":
        return f"off by default (reported kernel bug); set {ENV_FUSE_SHARED}=1"
    hidden, out_width = (shared_weight.shape[1], shared_weight.shape[0]) if trans else tuple(shared_weight.shape)
    if not 0 < hidden <= MAX_SHARED_HIDDEN:
        return f"shared hidden size {hidden} is not in (0, {MAX_SHARED_HIDDEN}]"
    if not 0 < out_width < DIM_LIMIT:
        return f"shared output width {out_width} is not in (0, {DIM_LIMIT})"
    tokens = shared_x.shape[0]
    low, high = SHARED_TOPK_RANGE
    if tokens == 0 or rank_major_rows % tokens or not low <= rank_major_rows // tokens <= high:
        return f"{rank_major_rows} routed rows for {tokens} shared rows is not a top-k in [{low}, {high}]"
    return None


def hcom_name(group: Any) -> str:
    """The HCCL communicator name of ``group``, asked with this process's *global* rank.

    The group-local rank silently selects another replica's communicator (NaN gradients, as
    recorded by xtuner).
    """
    group = group if group is not None else dist.group.WORLD
    if group not in _hcom_names:
        backend = group._get_backend(torch.device("npu"))
        _hcom_names[group] = backend.get_hccl_comm_name(dist.get_rank())
    return _hcom_names[group]


def _side_stream(device: torch.device) -> Any:
    key = str(device)
    if key not in _side_streams:
        _side_streams[key] = platform.new_stream(device)
    return _side_streams[key]


def _start(run: Run, x: torch.Tensor) -> tuple[Any, list[torch.Tensor] | None, dict[str, Any]]:
    """Launch ``run.side`` on the side stream; returns the stream, the side job's outputs and the
    keywords both kernels take (the fused shared expert, the weights' flags)."""
    stream = _side_stream(x.device) if run.side is not None else None
    side_out = run.side(stream) if run.side is not None else None
    mm_x, mm_weight, trans_mm = run.fused_shared if run.fused_shared is not None else (None, None, False)
    options = dict(mm_x=mm_x, mm_weight=mm_weight, trans_gmm_weight=run.trans_weight, trans_mm_weight=trans_mm)
    return stream, side_out, options


def _finish(
    run: Run, stream: Any, side_out: list[torch.Tensor] | None, mm_y: torch.Tensor | None, x_expert_major: torch.Tensor
) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Wait for the side stream; returns the shared expert's outputs (the kernel's ``mm_y`` where it
    was fused) and, with ``run.dw_x``, ``dW(dw_x, x_expert_major)`` (the run's expert-major rows)."""
    platform.wait_stream(stream)
    dw = None
    if run.dw_x is not None:
        dw = grad_weight(
            run.dw_x, x_expert_major, run.weight, run.plan.rows_per_expert_e, run.dw_trans, run.gmm_backend
        )
    return ([mm_y] if run.fused_shared is not None else side_out), dw


def dispatch(run: Run, x_rank_major: torch.Tensor, *, want_permuted: bool = False, compute_y: bool = True) -> Result:
    """:func:`epmoe.comm.fused.pipelined.dispatch`, run by ``npu_alltoallv_gmm``."""
    plan = run.plan
    stream, side_out, options = _start(run, x_rank_major)
    y, mm_y, permute_out = platform.torch_npu().npu_alltoallv_gmm(
        x_rank_major.contiguous(),
        run.weight.contiguous(),
        hcom_name(run.group),
        plan.ep_size,
        list(plan.counts_rank_major_WE),
        list(plan.counts_expert_major_WE),
        permute_out_flag=want_permuted or run.dw_x is not None,
        **options,
    )
    # the rows of permute_out are grouped by the *received* per-expert counts
    side, dw = _finish(run, stream, side_out, mm_y, permute_out)
    return Result(
        y=y if compute_y else None, permuted=permute_out if want_permuted else None, side=side, grad_weight=dw
    )


def combine(run: Run, x_expert_major: torch.Tensor, *, addend: torch.Tensor | None = None) -> Result:
    """:func:`epmoe.comm.fused.pipelined.combine`, run by ``npu_gmm_alltoallv`` (no ``addend``)."""
    if addend is not None:
        raise ValueError("npu_gmm_alltoallv cannot add to its grouped matmul's output; use the pipelined path")
    plan = run.plan
    stream, side_out, options = _start(run, x_expert_major)
    y, mm_y = platform.torch_npu().npu_gmm_alltoallv(
        x_expert_major.contiguous(),
        run.weight.contiguous(),
        hcom_name(run.group),
        plan.ep_size,
        list(plan.counts_expert_major_WE),
        list(plan.counts_rank_major_WE),
        **options,
    )
    side, dw = _finish(run, stream, side_out, mm_y, x_expert_major)
    return Result(y=y, permuted=None, side=side, grad_weight=dw)
