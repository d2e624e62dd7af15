"""A CPU emulation of the two ``torch_npu`` ops epmoe calls, written from the vendor's documentation.

There is no Ascend NPU here, so :mod:`epmoe.gmm.npu` is tested against this stand-in. It follows the
documented semantics (``docs/context/torch_npu-npu_grouped_matmul.md`` in Ascend/op-plugin) and
rejects, with an :class:`NpuOpError`, what those docs say the real op rejects. Only the scenarios
epmoe uses are emulated; any other one raises :class:`NotImplementedError`, so a change of calling
convention in epmoe shows up as a test failure rather than as a silently emulated call.

``npu_grouped_matmul`` scenarios emulated (non-quantized, single tensors, ``group_list`` a tensor)::

    group_type=0 (M-grouped)   x=[x_MK]      weight=[w_GKN]   -> [y_MN],  y[rows_g] = x[rows_g] @ w[g]
    group_type=2 (K-grouped)   x=[a_MK]      weight=[b_KN]    -> [y_GMN], y[g] = a[:, rows_g] @ b[rows_g]

``rows_g`` come from ``group_list`` (int64; ``group_list_type`` 0 = cumulative end offsets, 1 =
per-group counts). With ``group_type=0`` the weight may be a view of a ``(G, N, K)`` tensor
transposed in its last two dims (the kernel reads it as a transpose flag) but ``x`` may not be
transposed; with ``group_type=2`` ``x`` must be such a transposed view (``a_TK.t()``): the K-grouped
mode is used for weight gradients as ``npu_grouped_matmul([x.T], [dy], group_type=2, ...)``.
An empty group of the K-grouped mode gives zeros here (the real kernel has been reported not to
tolerate them; the backend never sends one, which the tests check through :attr:`FakeTorchNpu.calls`).

Install it for one test with the :func:`fake_torch_npu` fixture: ``epmoe.platform.torch_npu()`` then
returns a fresh :class:`FakeTorchNpu`, which records every call it receives.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from epmoe import platform

MAX_GROUPS = 1024
INNER_LIMIT = 65536
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NpuOpError(RuntimeError):
    """What the real op raises for an input its documentation rules out."""


@dataclass
class GmmCall:
    """One ``npu_grouped_matmul`` call as received: the tensors themselves, not copies."""

    x: torch.Tensor
    weight: torch.Tensor
    group_list: list[int]
    group_list_type: int
    group_type: int
    split_item: int
    x_transposed: bool
    weight_transposed: bool


def _transposed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a transposed view in its last two dims of a row-major tensor (the op's flag)."""
    return not t.is_contiguous() and t.transpose(-2, -1).is_contiguous()


def _check_layout(t: torch.Tensor, name: str, *, allow_transposed: bool) -> bool:
    if t.is_contiguous():
        return False
    if allow_transposed and _transposed(t):
        return True
    raise NpuOpError(
        f"{name}: only a contiguous{' or transposed' if allow_transposed else ''} ND tensor is supported, "
        f"got shape {tuple(t.shape)} strides {t.stride()}"
    )


def _check_inner(t: torch.Tensor, name: str, transposed: bool) -> None:
    """The stored last dim (the K/N axis, or M/K when transposed) must be below the inner limit."""
    inner = t.shape[-2] if transposed else t.shape[-1]
    if inner >= INNER_LIMIT:
        raise NpuOpError(f"{name}: inner dim {inner} must be less than {INNER_LIMIT}")


def _bounds(group_list: torch.Tensor, group_list_type: int, total: int, axis: str) -> list[tuple[int, int]]:
    if not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("group_list as List[int] (group_type must then be None) is not emulated")
    if group_list.dtype != torch.int64:
        raise NpuOpError(f"group_list: dtype must be int64, got {group_list.dtype}")
    if group_list.dim() != 1:
        raise NpuOpError(f"group_list: must be 1-D, got shape {tuple(group_list.shape)}")
    values = group_list.tolist()
    if len(values) > MAX_GROUPS:
        raise NpuOpError(f"group_list: at most {MAX_GROUPS} groups, got {len(values)}")
    if any(v < 0 for v in values):
        raise NpuOpError(f"group_list: values must be non-negative, got {values}")
    if group_list_type == 0:
        if any(b < a for a, b in zip(values, values[1:])):
            raise NpuOpError(f"group_list: cumulative offsets must be non-decreasing, got {values}")
        ends = values
    elif group_list_type == 1:
        if len(values) == 1:
            raise NpuOpError("group_list: with group_list_type=1 its length cannot be 1")
        ends, acc = [], 0
        for v in values:
            acc += v
            ends.append(acc)
    elif group_list_type == 2:
        raise NpuOpError("group_list_type=2 is only supported for int8 x/weight with group_type=0")
    else:
        raise NpuOpError(f"group_list_type: must be 0, 1 or 2, got {group_list_type}")
    if (ends[-1] if ends else 0) != total:
        raise NpuOpError(f"group_list: groups cover {ends[-1] if ends else 0} along {axis}, the tensor has {total}")
    return list(zip([0] + ends[:-1], ends))


class FakeTorchNpu(types.ModuleType):
    """Stand-in ``torch_npu`` module: ``npu_grouped_matmul`` and ``npu_swiglu`` on CPU tensors."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[GmmCall] = []
        self.swiglu_calls: list[tuple[torch.Size, int]] = []

    def npu_grouped_matmul(
        self,
        x,
        weight,
        *,
        bias=None,
        scale=None,
        offset=None,
        antiquant_scale=None,
        antiquant_offset=None,
        per_token_scale=None,
        group_list=None,
        activation_input=None,
        activation_quant_scale=None,
        activation_quant_offset=None,
        split_item=0,
        group_type=None,
        group_list_type=0,
        act_type=0,
        output_dtype=None,
        tuning_config=None,
    ) -> list[torch.Tensor]:
        extras = (
            bias,
            scale,
            offset,
            antiquant_scale,
            antiquant_offset,
            per_token_scale,
            activation_input,
            activation_quant_scale,
            activation_quant_offset,
            tuning_config,
        )
        if any(e is not None for e in extras) or act_type != 0:
            raise NotImplementedError("bias, quantization and fused activations are not emulated")
        if not (isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple))):
            raise NpuOpError("x and weight must be lists of tensors")
        if len(x) != 1 or len(weight) != 1:
            raise NotImplementedError("only single-tensor x and weight are emulated")
        if split_item not in (0, 1, 2, 3):
            raise NpuOpError(f"split_item: must be 0..3, got {split_item}")
        if split_item in (0, 1):
            raise NpuOpError("a single x tensor with a single 3-D weight needs split_item 2 or 3 (single output)")
        (a,), (w,) = x, weight
        if a.dtype not in DTYPES:
            raise NpuOpError(f"x: dtype {a.dtype} is not supported (non-quantized: float16, bfloat16, float32)")
        if w.dtype != a.dtype:
            raise NpuOpError(f"weight: dtype {w.dtype} must match x's {a.dtype}")
        if output_dtype not in (None, a.dtype):
            raise NpuOpError(f"output_dtype: must be None or {a.dtype}, got {output_dtype}")
        if a.device != w.device:
            raise NpuOpError("x and weight must be on the same device")

        if group_type == 0:
            out, x_t, w_t, values = self._m_grouped(a, w, group_list, group_list_type)
        elif group_type == 2:
            out, x_t, w_t, values = self._k_grouped(a, w, group_list, group_list_type)
        elif group_type in (-1, 1):
            raise NotImplementedError(f"group_type={group_type} is not emulated")
        else:
            raise NpuOpError(f"group_type: must be -1, 0, 1 or 2, got {group_type}")
        self.calls.append(GmmCall(a, w, values, group_list_type, group_type, split_item, x_t, w_t))
        return [out]

    @staticmethod
    def _m_grouped(a, w, group_list, group_list_type):
        if a.dim() != 2 or w.dim() != 3:
            raise NpuOpError(f"group_type=0 needs a 2-D x and a 3-D weight, got {tuple(a.shape)} and {tuple(w.shape)}")
        _check_layout(a, "x (transposed x is not supported)", allow_transposed=False)
        w_t = _check_layout(w, "weight", allow_transposed=True)
        _check_inner(a, "x", False)
        _check_inner(w, "weight", w_t)
        if w.shape[1] != a.shape[1]:
            raise NpuOpError(f"x is {tuple(a.shape)} but weight is {tuple(w.shape)}: K differs")
        bounds = _bounds(group_list, group_list_type, a.shape[0], "the rows of x")
        if len(bounds) != w.shape[0]:
            raise NpuOpError(f"group_list has {len(bounds)} groups, weight has {w.shape[0]}")
        out = a.new_empty(a.shape[0], w.shape[2])
        for g, (start, end) in enumerate(bounds):
            out[start:end] = (a[start:end].float() @ w[g].float()).to(a.dtype)
        return out, False, w_t, group_list.tolist()

    @staticmethod
    def _k_grouped(a, w, group_list, group_list_type):
        if a.dim() != 2 or w.dim() != 2:
            raise NpuOpError(f"group_type=2 needs a 2-D x and weight, got {tuple(a.shape)} and {tuple(w.shape)}")
        if not a.transpose(0, 1).is_contiguous():
            raise NpuOpError(
                "x: group_type=2 needs x as a transposed view (x_TK.t()); a contiguous copy loses the transpose flag"
            )
        _check_layout(w, "weight", allow_transposed=False)
        _check_inner(a, "x", True)
        _check_inner(w, "weight", False)
        if w.shape[0] != a.shape[1]:
            raise NpuOpError(f"x is {tuple(a.shape)} but weight is {tuple(w.shape)}: the grouped K differs")
        bounds = _bounds(group_list, group_list_type, a.shape[1], "the grouped K axis")
        out = a.new_zeros(len(bounds), a.shape[0], w.shape[1])
        for g, (start, end) in enumerate(bounds):
            out[g] = (a[:, start:end].float() @ w[start:end].float()).to(a.dtype)
        return out, True, False, group_list.tolist()

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """``silu(a) * b`` with ``a, b = x.chunk(2, dim)``."""
        if x.dtype not in DTYPES:
            raise NpuOpError(f"npu_swiglu: dtype {x.dtype} is not supported")
        if x.shape[dim] % 2:
            raise NpuOpError(f"npu_swiglu: dim {dim} has odd size {x.shape[dim]}")
        self.swiglu_calls.append((x.shape, dim))
        gate, up = x.float().chunk(2, dim)
        return (F.silu(gate) * up).to(x.dtype)


def install(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    """Make ``epmoe.platform.torch_npu()`` return a fresh emulation for the rest of the test."""
    fake = FakeTorchNpu()
    monkeypatch.setattr(platform, "torch_npu", lambda: fake)
    return fake


@pytest.fixture
def fake_torch_npu(monkeypatch) -> FakeTorchNpu:
    """A :class:`FakeTorchNpu` standing in for ``torch_npu`` (tensors stay on the CPU)."""
    return install(monkeypatch)
