"""The ``torch`` backend: ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``).

One kernel call per grouped matmul with int32 cumulative end offsets, computed on the device from
device counts (``device_counts``: no host read). It declines where the kernel
is missing, wrong or slow (see :meth:`TorchBackend.ineligible_reason`):

    torch <  2.8         no kernel
    torch == 2.8         CUDA SM90 only
    torch >= 2.9         CPU (per-group loop in C++), CUDA SM80+ (fast path only for bf16 on SM90+;
                         other dtypes use a fallback that syncs the host on every call)
    every version        strides a multiple of 16 bytes (CPU and CUDA); 16-byte aligned data
                         pointers (CUDA only: the CPU kernel reads any address, checked on 2.13)
"""

from __future__ import annotations

import torch

from epmoe import platform
from epmoe.gmm.backend import GmmBackend

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# the grouped-matmul kernel of this torch build (public, or the private one of older builds), or None
_KERNEL = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _misaligned(name: str, t: torch.Tensor, *, check_pointer: bool) -> str | None:
    """Why ``t`` breaks the kernel's 16-byte stride rule (and, with ``check_pointer``, its 16-byte
    data-pointer rule), or ``None``."""
    size = t.element_size()
    strides = t.stride()[-2:]
    if 1 not in strides:
        return f"{name} has no unit stride in its last two dims (strides {t.stride()})"
    other = strides[0] if strides[1] == 1 else strides[1]
    if (other * size) % 16:
        return f"{name} stride {other} x {size} B is not a multiple of 16 bytes (inner dim must be a multiple of {16 // size})"
    if check_pointer and t.data_ptr() % 16:
        return f"{name} data pointer is not 16-byte aligned"
    return None


class TorchBackend(GmmBackend):
    """On CPU the kernel is ATen's ``_grouped_mm_fallback``: one ``at::mm_out`` per group, i.e. the
    ``loop`` backend in C++, without Python's per-group overhead and without zero-filling ``dW``.
    Measured (``epmoe bench gmm``, benchmarks/gmm_cpu.md, and a sweep of 1 to 256 rows per group)
    it is never slower than ``loop`` beyond timing noise, so on CPU it declines only what the kernel
    rejects: a dtype outside bf16/fp16/fp32, and strides of ``x``, ``weight`` or the ``(T, N)`` output
    (which the backward reads) that are not multiples of 16 bytes. It runs inside epmoe's
    ``grouped_mm`` custom op, so ``torch.compile`` never traces the kernel (whose fake kernel on CPU
    accepts only bf16).
    """

    name = "torch"
    device_counts = True

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        if _KERNEL is None:
            return f"torch {torch.__version__} has no grouped_mm kernel"
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype} is not one of bf16/fp16/fp32"
        version = _torch_version()
        kind = platform.device_type(x)
        if kind == "cpu":
            if version < (2, 9):
                return f"torch {torch.__version__} has no CPU grouped_mm kernel (needs 2.9+)"
        elif kind == "cuda":
            capability = platform.device_capability(x.device)
            if version < (2, 9) and capability != (9, 0):
                return f"torch {torch.__version__} grouped_mm runs only on SM90 (device is SM{capability[0]}{capability[1]})"
            if capability is not None and capability < (8, 0):
                return f"grouped_mm needs CUDA SM80+, device is SM{capability[0]}{capability[1]}"
            if x.dtype != torch.bfloat16:
                return f"on CUDA only bf16 has a fast grouped_mm path ({x.dtype} syncs the host and loops)"
        else:
            return f"no grouped_mm kernel on device type {kind!r}"
        w_GDN = weight.transpose(1, 2) if trans_weight else weight
        n_bytes = w_GDN.shape[2] * x.element_size()
        if n_bytes % 16:  # dy (T, N) feeds the backward kernels
            return f"output width N={w_GDN.shape[2]} x {x.element_size()} B is not a multiple of 16 bytes (backward needs it)"
        check_pointer = kind == "cuda"
        return _misaligned("x", x, check_pointer=check_pointer) or _misaligned(
            "weight", w_GDN, check_pointer=check_pointer
        )

    @staticmethod
    def _offsets(counts: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
        """The kernel's int32 cumulative end offsets (computed where the counts are)."""
        offsets = torch.as_tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        return platform.host_to_device(offsets, device)

    def forward(self, x_TD, weight, counts, trans_weight):
        w_GDN = weight.transpose(1, 2) if trans_weight else weight
        return _KERNEL(x_TD, w_GDN, offs=self._offsets(counts, x_TD.device))

    def grad_weight(self, x_TD, dy_TN, counts, trans_weight):
        offs = self._offsets(counts, x_TD.device)
        if trans_weight:
            dw = _KERNEL(dy_TN.t(), x_TD, offs=offs)  # (G, N, D)
        else:
            dw = _KERNEL(x_TD.t(), dy_TN, offs=offs)  # (G, D, N)
        # the kernel leaves empty groups zero on most builds, not all (pytorch#172439); on CPU each
        # group is one at::mm_out, which writes zeros for an empty contraction (checked on 2.13 with
        # recycled NaN-filled memory)
        if isinstance(counts, torch.Tensor):
            return dw if dw.device.type == "cpu" else dw.masked_fill_((counts == 0).view(-1, 1, 1), 0)
        empty = [g for g, n in enumerate(counts) if n == 0]
        if empty:
            dw[empty] = 0
        return dw
