"""The ``npu`` backend: ``torch_npu.npu_grouped_matmul`` on Ascend NPUs.

Forward and ``dX`` are M-grouped calls (``group_type=0``) with a counts group list
(``group_list_type=1``); a transposed weight is passed as a transposed view, which the kernel reads
as a flag (no copy). The kernel reads no other weight layout, so any other (a strided slice, say) is
declined rather than copied. ``dW`` uses the K-grouped mode (``group_type=2``, contraction over each
group's rows) when every group has rows, and a per-group matmul loop otherwise: the K-grouped kernel
has been reported not to tolerate empty groups. A single group is one plain matmul: the documented
op rejects a counts group list of length 1.

It takes its counts on the host (``device_counts`` is off): the weight gradient must know which
groups are empty before it picks the kernel, so an EP layer on one rank reads them once per forward
and once per backward on an NPU.

Written against the vendor's documented semantics; tested only against the CPU emulation in
``tests/support/npu_emulation.py``, never on Ascend hardware.
"""

from __future__ import annotations

import torch

from epmoe import platform
from epmoe.gmm.backend import GmmBackend
from epmoe.gmm.loop import LoopBackend

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GROUPS = 1024
MAX_INNER_DIM = 65535


class NpuBackend(GmmBackend):
    name = "npu"

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        if platform.torch_npu() is None:
            return "torch_npu is not installed"
        if platform.device_type(x) != "npu":
            return f"tensors are on {platform.device_type(x)!r}, not an NPU"
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype} is not one of bf16/fp16/fp32"
        if weight.shape[0] > MAX_GROUPS:
            return f"{weight.shape[0]} groups exceed the kernel's limit of {MAX_GROUPS}"
        too_big = [d for d in (x.shape[1], *weight.shape[1:]) if d > MAX_INNER_DIM]
        if too_big:
            return f"inner dims {too_big} exceed the kernel's limit of {MAX_INNER_DIM}"
        if not (weight.is_contiguous() or weight.transpose(1, 2).is_contiguous()):
            return (
                f"weight strides {weight.stride()} are neither contiguous nor transposed in the last two dims "
                f"(the only layouts the kernel reads)"
            )
        return None

    @staticmethod
    def _group_list(counts: list[int], device: torch.device) -> torch.Tensor:
        return platform.host_to_device(torch.tensor(counts, dtype=torch.int64), device)

    def forward(self, x_TD, weight, counts, trans_weight):
        if len(counts) == 1:
            return LoopBackend().forward(x_TD, weight, counts, trans_weight)
        w_GDN = weight.transpose(1, 2) if trans_weight else weight
        (y_TN,) = platform.torch_npu().npu_grouped_matmul(
            [x_TD],
            [w_GDN],
            group_list=self._group_list(counts, x_TD.device),
            split_item=3,
            group_type=0,
            group_list_type=1,
        )
        return y_TN

    def grad_weight(self, x_TD, dy_TN, counts, trans_weight):
        if 0 in counts or len(counts) == 1:
            return LoopBackend().grad_weight(x_TD, dy_TN, counts, trans_weight)
        a, b = (dy_TN, x_TD) if trans_weight else (x_TD, dy_TN)
        (dw,) = platform.torch_npu().npu_grouped_matmul(
            [a.t()],
            [b],
            group_list=self._group_list(counts, x_TD.device),
            split_item=3,
            group_type=2,
            group_list_type=1,
        )
        return dw
