"""A CPU emulation of ``torch_npu.npu_alltoallv_gmm`` and ``npu_gmm_alltoallv``, from their documentation.

There is no Ascend NPU here, so the ``npu_fused`` path of :mod:`epmoe.comm.fused` is tested against
this stand-in, run on gloo ranks. It is written from the vendor documentation
(``reference/004_681fde38627975e4.txt``, ``docs/context/torch_npu-npu_alltoallv_gmm.md``) and the
kernel behaviour recorded in ``reference/npu-fused-ops-layout.md`` section 1, independently of
epmoe's own layout code:

* dispatch: one AlltoAllV per local expert ``j``; round ``j`` sends block ``(r, j)`` of the
  rank-major ``gmm_x`` to every rank ``r`` and receives from source ``s`` at offset
  ``sum(recv rows of experts < j) + sum(recv_counts[s'*e + j] for s' < s)``: the communication itself
  produces the expert-major ``permute_out``; then ``gmm_y[j] = permute_out[j] @ W[j]``.
* combine: ``gmm_y[j] = gmm_x[j] @ W[j]``; round ``j`` sends expert ``j``'s rows back, source-rank
  by source-rank, and each arriving block lands at its rank-major offset.
* ``mm_y = mm_x @ mm_weight`` when both are given.

Every documented constraint is enforced (:class:`FusedOpError`), with the world sizes, dtypes and
per-peer volume limits configurable so that small gloo tests can reach the path; no autograd is
recorded (outputs never require grad), as with the real ops. Every call is kept in ``calls``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ROWS_LIMIT = 52428800
DIM_LIMIT = 65536
MAX_SHARED_HIDDEN = 12288


class FusedOpError(RuntimeError):
    """What the real op rejects, per its documentation or kernel tiling checks."""


@dataclass
class FusedCall:
    op: str
    send_counts: list[int]
    recv_counts: list[int]
    trans_gmm_weight: bool
    permute_out_flag: bool
    with_mm: bool


@dataclass
class EmulatedTorchNpu:
    """Stands in for the ``torch_npu`` module: the two fused ops, on gloo."""

    world_sizes: tuple[int, ...] = (8, 16, 32, 64)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    min_peer_bytes: int = 2 * 2**20
    max_peer_bytes: int = 100 * 2**20
    calls: list[FusedCall] = field(default_factory=list)
    groups: dict[str, Any] = field(default_factory=dict)

    def register(self, group: Any) -> str:
        """A communicator name for ``group`` (what ``get_hccl_comm_name`` gives on an NPU)."""
        for name, known in self.groups.items():
            if known is group:
                return name
        name = f"emulated_hcom_{len(self.groups)}"
        self.groups[name] = group
        return name

    # -- the ops ---------------------------------------------------------------------------------

    def npu_alltoallv_gmm(
        self,
        gmm_x,
        gmm_weight,
        hcom,
        ep_world_size,
        send_counts,
        recv_counts,
        *,
        send_counts_tensor=None,
        recv_counts_tensor=None,
        mm_x=None,
        mm_weight=None,
        trans_gmm_weight=False,
        trans_mm_weight=False,
        permute_out_flag=False,
    ):
        group, e = self._check(
            "npu_alltoallv_gmm",
            gmm_x,
            gmm_weight,
            hcom,
            ep_world_size,
            send_counts,
            recv_counts,
            send_counts_tensor,
            recv_counts_tensor,
            mm_x,
            mm_weight,
            trans_mm_weight,
        )
        self.calls.append(
            FusedCall(
                "npu_alltoallv_gmm",
                list(send_counts),
                list(recv_counts),
                trans_gmm_weight,
                permute_out_flag,
                mm_x is not None,
            )
        )
        W = ep_world_size
        with torch.no_grad():
            send_offsets = _prefix(send_counts)
            received = []
            for j in range(e):  # one AlltoAllV per local expert
                blocks = [gmm_x[send_offsets[r * e + j] : send_offsets[r * e + j + 1]] for r in range(W)]
                out_splits = [recv_counts[s * e + j] for s in range(W)]
                out = gmm_x.new_empty(sum(out_splits), gmm_x.shape[1])
                dist.all_to_all_single(out, torch.cat(blocks), out_splits, [b.shape[0] for b in blocks], group=group)
                received.append(out)
            permute_out = torch.cat(received)
            gmm_y = torch.cat([_mm(rows, gmm_weight[j], trans_gmm_weight) for j, rows in enumerate(received)])
            mm_y = _mm(mm_x, mm_weight, trans_mm_weight) if mm_x is not None else gmm_x.new_empty(0)
        return gmm_y, mm_y, permute_out if permute_out_flag else gmm_x.new_empty(0)

    def npu_gmm_alltoallv(
        self,
        gmm_x,
        gmm_weight,
        hcom,
        ep_world_size,
        send_counts,
        recv_counts,
        *,
        send_counts_tensor=None,
        recv_counts_tensor=None,
        mm_x=None,
        mm_weight=None,
        trans_gmm_weight=False,
        trans_mm_weight=False,
    ):
        group, e = self._check(
            "npu_gmm_alltoallv",
            gmm_x,
            gmm_weight,
            hcom,
            ep_world_size,
            send_counts,
            recv_counts,
            send_counts_tensor,
            recv_counts_tensor,
            mm_x,
            mm_weight,
            trans_mm_weight,
        )
        self.calls.append(
            FusedCall(
                "npu_gmm_alltoallv", list(send_counts), list(recv_counts), trans_gmm_weight, False, mm_x is not None
            )
        )
        W = ep_world_size
        with torch.no_grad():
            n_out = gmm_weight.shape[1] if trans_gmm_weight else gmm_weight.shape[2]
            y = gmm_x.new_empty(sum(recv_counts), n_out)
            recv_offsets = _prefix(recv_counts)
            row = 0
            for j in range(e):  # expert j's matmul, then its AlltoAllV
                in_splits = [send_counts[s * e + j] for s in range(W)]
                gmm_y_j = _mm(gmm_x[row : row + sum(in_splits)], gmm_weight[j], trans_gmm_weight)
                row += sum(in_splits)
                out_splits = [recv_counts[r * e + j] for r in range(W)]
                out = gmm_x.new_empty(sum(out_splits), n_out)
                dist.all_to_all_single(out, gmm_y_j.contiguous(), out_splits, in_splits, group=group)
                start = 0
                for r in range(W):  # the receive offsets are rank-major: the communication unpermutes
                    y[recv_offsets[r * e + j] : recv_offsets[r * e + j + 1]] = out[start : start + out_splits[r]]
                    start += out_splits[r]
            mm_y = _mm(mm_x, mm_weight, trans_mm_weight) if mm_x is not None else gmm_x.new_empty(0)
        return y, mm_y

    # -- the documented constraints --------------------------------------------------------------

    def _check(
        self,
        op,
        gmm_x,
        gmm_weight,
        hcom,
        W,
        send_counts,
        recv_counts,
        send_tensor,
        recv_tensor,
        mm_x,
        mm_weight,
        trans_mm_weight,
    ):
        if not isinstance(hcom, str) or not 0 < len(hcom) < 128 or hcom not in self.groups:
            raise FusedOpError(f"{op}: unknown or invalid hcom {hcom!r}")
        group = self.groups[hcom]
        if dist.get_world_size(group) != W:
            raise FusedOpError(f"{op}: ep_world_size {W} is not the communicator's size {dist.get_world_size(group)}")
        if W not in self.world_sizes:
            raise FusedOpError(f"{op}: ep_world_size {W} not in {self.world_sizes}")
        if send_tensor is not None or recv_tensor is not None:
            raise FusedOpError(f"{op}: send_counts_tensor / recv_counts_tensor are not supported")
        for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            if not isinstance(counts, list) or not all(type(c) is int for c in counts):
                raise FusedOpError(f"{op}: {name} must be a list of int")
        if gmm_x.dtype not in self.dtypes or gmm_weight.dtype != gmm_x.dtype:
            raise FusedOpError(f"{op}: dtypes {gmm_x.dtype} / {gmm_weight.dtype} not supported")
        if gmm_x.dim() != 2 or gmm_weight.dim() != 3 or not gmm_x.is_contiguous() or not gmm_weight.is_contiguous():
            raise FusedOpError(f"{op}: gmm_x must be 2-D and gmm_weight 3-D, both ND contiguous")
        e = gmm_weight.shape[0]
        if not 0 < e <= 32 or len(send_counts) != e * W or len(recv_counts) != e * W or e * W > 256:
            raise FusedOpError(f"{op}: e={e}, W={W}, counts lengths {len(send_counts)}/{len(recv_counts)}")
        if gmm_x.shape[0] != sum(send_counts):
            raise FusedOpError(f"{op}: gmm_x has {gmm_x.shape[0]} rows, send_counts sum to {sum(send_counts)}")
        for dim in (*gmm_x.shape[1:], *gmm_weight.shape[1:]):
            if not 0 < dim < DIM_LIMIT:
                raise FusedOpError(f"{op}: dim {dim} not in (0, {DIM_LIMIT})")
        for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            if not 0 < sum(counts) < ROWS_LIMIT:
                raise FusedOpError(f"{op}: {name} total {sum(counts)} not in (0, {ROWS_LIMIT})")
            for peer in range(W):  # per peer, counted with the input width H1 (also for the combine)
                volume = sum(counts[peer * e : (peer + 1) * e]) * gmm_x.shape[1] * gmm_x.element_size()
                if not self.min_peer_bytes <= volume <= self.max_peer_bytes:
                    raise FusedOpError(f"{op}: {name} volume {volume} B with rank {peer} out of range")
        if (mm_x is None) != (mm_weight is None):
            raise FusedOpError(f"{op}: mm_x and mm_weight must be given together")
        if mm_x is not None:
            hidden = mm_weight.shape[1] if trans_mm_weight else mm_weight.shape[0]
            if mm_x.dtype != gmm_x.dtype or mm_weight.dtype != gmm_x.dtype or not 0 < hidden <= MAX_SHARED_HIDDEN:
                raise FusedOpError(f"{op}: shared expert dtype or H2={hidden} not supported")
            bsk = gmm_x.shape[0] if op == "npu_alltoallv_gmm" else sum(recv_counts)
            if bsk % mm_x.shape[0] or not 2 <= bsk // mm_x.shape[0] <= 8:
                raise FusedOpError(f"{op}: top-k {bsk} / {mm_x.shape[0]} not in [2, 8]")
        return group, e


def _prefix(counts: list[int]) -> list[int]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _mm(x: torch.Tensor, weight: torch.Tensor, trans: bool) -> torch.Tensor:
    return x @ (weight.t() if trans else weight)
