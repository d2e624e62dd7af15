"""The ``npu`` grouped-matmul backend against the CPU emulation of ``torch_npu`` (no Ascend NPU here).

Checks numbers against a float64 per-group reference, the argument conventions the backend sends to
``npu_grouped_matmul`` (recorded by the emulation), its eligibility reasons, and the emulation itself.
"""

import pytest
import torch
import torch.nn.functional as F
from npu_emulation import MAX_GROUPS, NpuOpError, fake_torch_npu  # noqa: F401 - fixture

import epmoe
from epmoe import platform
from epmoe.gmm.npu import NpuBackend
from epmoe.gmm.registry import select_backend

COUNTS = [[5, 0, 7, 3], [3, 4, 5], [0, 0, 9], [12], [0, 12, 0, 0], [1, 1, 1, 1, 1, 1]]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(x, weight, counts, trans_weight):
    """Float64 per-group matmul."""
    w = weight.double().transpose(1, 2) if trans_weight else weight.double()
    out, start = [], 0
    for g, n in enumerate(counts):
        out.append(x[start : start + n].double() @ w[g])
        start += n
    return torch.cat(out)


def operands(counts, trans_weight, dtype, K=16, N=8):
    G = len(counts)
    x = torch.randn(sum(counts), K, dtype=dtype)
    weight = torch.randn((G, N, K) if trans_weight else (G, K, N), dtype=dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trans_weight", [False, True])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_autograd_against_float64(fake_torch_npu, claims_npu, counts, trans_weight, dtype):
    x, weight = operands(counts, trans_weight, dtype)
    x.requires_grad_()
    weight.requires_grad_()
    y = epmoe.grouped_mm(x, weight, counts, trans_weight=trans_weight, backend="npu")
    dy = torch.randn_like(y)
    y.backward(dy)

    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference(x64, w64, counts, trans_weight).backward(dy.double())
    y64 = reference(x64.detach(), w64.detach(), counts, trans_weight)
    atol, T, K, N = TOL[dtype], x.shape[0], x.shape[1], y.shape[1]
    assert y.dtype == x.grad.dtype == weight.grad.dtype == dtype
    torch.testing.assert_close(y.double(), y64, atol=atol * K, rtol=atol)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol * N, rtol=atol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=atol * T, rtol=atol)
    for g, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(weight.grad[g]) == 0

    if len(counts) == 1:
        assert fake_torch_npu.calls == []  # a counts group list of length 1 is rejected by the op
        return
    fwd, dx = fake_torch_npu.calls[:2]
    for call in (fwd, dx):
        assert (call.group_type, call.group_list_type, call.group_list) == (0, 1, counts)
        assert call.split_item in (2, 3) and not call.x_transposed
    assert fwd.x.data_ptr() == x.data_ptr()
    # Both weight layouts reach the kernel as the caller's storage: the transposed one as a flag.
    assert fwd.weight.data_ptr() == dx.weight.data_ptr() == weight.data_ptr()
    assert (fwd.weight_transposed, dx.weight_transposed) == (trans_weight, not trans_weight)
    if 0 in counts:
        assert len(fake_torch_npu.calls) == 2  # dW by the per-group loop
    else:
        (dw,) = fake_torch_npu.calls[2:]
        assert (dw.group_type, dw.group_list_type, dw.group_list) == (2, 1, counts)
        assert dw.x_transposed and not dw.weight_transposed


@pytest.mark.parametrize("trans_weight", [False, True])
def test_forward_direct(fake_torch_npu, trans_weight):
    counts = [4, 0, 6]
    x, weight = operands(counts, trans_weight, torch.float32)
    y = NpuBackend().forward(x, weight, counts, trans_weight)
    torch.testing.assert_close(y.double(), reference(x, weight, counts, trans_weight), atol=1e-4, rtol=1e-5)
    (call,) = fake_torch_npu.calls
    assert call.x is x and call.weight.data_ptr() == weight.data_ptr() and call.weight_transposed == trans_weight


@pytest.mark.parametrize("trans_weight", [False, True])
@pytest.mark.parametrize("counts", [[4, 2, 6], [4, 0, 6], [0, 10, 0]], ids=str)
def test_grad_weight_direct(fake_torch_npu, counts, trans_weight):
    T, K, N = sum(counts), 12, 5
    x, dy = torch.randn(T, K), torch.randn(T, N)
    dw = NpuBackend().grad_weight(x, dy, counts, trans_weight)
    assert dw.shape == ((len(counts), N, K) if trans_weight else (len(counts), K, N))
    start = 0
    for g, n in enumerate(counts):
        expected = x[start : start + n].double().t() @ dy[start : start + n].double()
        got = dw[g].double().t() if trans_weight else dw[g].double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
        if n == 0:
            assert torch.count_nonzero(dw[g]) == 0
        start += n
    if 0 in counts:
        assert fake_torch_npu.calls == []
    else:
        (call,) = fake_torch_npu.calls
        assert call.group_type == 2 and call.x_transposed
        # The transposed operand is a view of the caller's row-major tensor, not a copy.
        assert call.x.data_ptr() == (dy if trans_weight else x).data_ptr()
        assert call.weight is (x if trans_weight else dy)


# Eligibility ------------------------------------------------------------------------------------


def test_reason_without_torch_npu(monkeypatch):
    monkeypatch.setattr(platform, "torch_npu", lambda: None)
    assert NpuBackend().ineligible_reason(torch.randn(4, 8), torch.randn(2, 8, 4)) == "torch_npu is not installed"


def test_reason_not_on_npu(fake_torch_npu):
    x, w = torch.randn(4, 8), torch.randn(2, 8, 4)
    reason = "tensors are on 'cpu', not an NPU"
    assert NpuBackend().ineligible_reason(x, w) == reason
    with pytest.raises(ValueError, match=f"backend='npu'.*{reason}"):
        select_backend(x, w, backend="npu")
    statuses = {s.name: s for s in epmoe.gmm_backends(x, w)}
    assert not statuses["npu"].eligible and statuses["npu"].reason == reason


@pytest.fixture
def claims_npu(fake_torch_npu, monkeypatch):
    """Shape/dtype rules are checked on "meta" tensors, which a patched device check calls NPU tensors."""
    monkeypatch.setattr(platform, "device_type", lambda obj=None: "npu")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "x,w,trans_weight,reason",
    [
        (meta(8, 64), meta(4, 64, 32), False, None),
        (meta(8, 64), meta(4, 32, 64), True, None),
        (meta(8, 64, dtype=torch.float32), meta(4, 64, 32, dtype=torch.float32), False, None),
        (
            meta(8, 64, dtype=torch.float64),
            meta(4, 64, 32, dtype=torch.float64),
            False,
            "dtype torch.float64 is not one of bf16/fp16/fp32",
        ),
        (meta(8, 64), meta(MAX_GROUPS, 64, 32), False, None),
        (meta(8, 64), meta(MAX_GROUPS + 1, 64, 32), False, "1025 groups exceed the kernel's limit of 1024"),
        (meta(8, 65535), meta(4, 65535, 65535), False, None),
        (meta(8, 65536), meta(4, 65536, 32), False, "inner dims [65536, 65536] exceed the kernel's limit of 65535"),
        (meta(8, 64), meta(4, 64, 65536), False, "inner dims [65536] exceed the kernel's limit of 65535"),
        (meta(8, 64), meta(4, 65536, 64), True, "inner dims [65536] exceed the kernel's limit of 65535"),
        (meta(8, 64), meta(4, 32, 64).transpose(1, 2), False, None),  # read with the transpose flag
        (meta(8, 64), meta(4, 64, 32).transpose(1, 2), True, None),
        (
            meta(8, 16),
            meta(4, 16, 8)[::2],
            False,
            "weight strides (256, 8, 1) are neither contiguous nor transposed in the last two dims "
            "(the only layouts the kernel reads)",
        ),
        (
            meta(8, 16),
            meta(2, 16, 16)[:, :, :8],
            False,
            "weight strides (256, 16, 1) are neither contiguous nor transposed in the last two dims "
            "(the only layouts the kernel reads)",
        ),
    ],
)
def test_reasons_on_npu(claims_npu, x, w, trans_weight, reason):
    assert NpuBackend().ineligible_reason(x, w, trans_weight=trans_weight) == reason


@pytest.mark.parametrize("trans_weight", [False, True])
def test_strided_weight_is_declined_not_crashed(fake_torch_npu, claims_npu, trans_weight):
    """A weight the kernel cannot read (a strided slice) goes to another backend instead of the op."""
    x, weight = torch.randn(6, 16), torch.randn(4, 16, 16)[::2]
    with pytest.raises(ValueError, match="backend='npu'.*neither contiguous nor transposed"):
        epmoe.grouped_mm(x, weight, [2, 4], trans_weight=trans_weight, backend="npu")
    y = epmoe.grouped_mm(x, weight, [2, 4], trans_weight=trans_weight)
    torch.testing.assert_close(y.double(), reference(x, weight, [2, 4], trans_weight), atol=1e-4, rtol=1e-5)
    assert fake_torch_npu.calls == []


# The emulation itself --------------------------------------------------------------------------


def gmm(fake, x, w, counts, **kwargs):
    args = dict(group_list=torch.tensor(counts, dtype=torch.int64), split_item=3, group_type=0, group_list_type=1)
    args.update(kwargs)
    return fake.npu_grouped_matmul([x], [w], **args)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_emulation_matches_reference(fake_torch_npu, group_list_type):
    counts = [3, 0, 5]
    x, w = torch.randn(8, 6), torch.randn(3, 6, 4)
    group_list = torch.tensor(counts).cumsum(0) if group_list_type == 0 else torch.tensor(counts)
    (y,) = gmm(fake_torch_npu, x, w, counts, group_list=group_list, group_list_type=group_list_type)
    torch.testing.assert_close(y.double(), reference(x, w, counts, False), atol=1e-5, rtol=1e-5)
    (y_t,) = gmm(
        fake_torch_npu,
        x,
        w.transpose(1, 2).contiguous().transpose(1, 2),
        counts,
        group_list=group_list,
        group_list_type=group_list_type,
    )
    torch.testing.assert_close(y_t, y)
    (dw,) = gmm(fake_torch_npu, x.t(), y, counts, group_list=group_list, group_list_type=group_list_type, group_type=2)
    assert dw.shape == (3, 6, 4) and torch.count_nonzero(dw[1]) == 0
    torch.testing.assert_close(dw[2], x[3:].t() @ y[3:])


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x, w: dict(group_list=torch.tensor([2, 0, 2], dtype=torch.int32)), "int64"),
        (lambda x, w: dict(group_list=[2, 0, 2]), "List"),
        (lambda x, w: dict(group_list_type=2), "group_list_type=2"),
        (lambda x, w: dict(group_list_type=3), "group_list_type"),
        (lambda x, w: dict(group_type=1), "group_type=1"),
        (lambda x, w: dict(group_type=-1), "group_type=-1"),
        (lambda x, w: dict(split_item=0), "split_item"),
        (lambda x, w: dict(group_list=torch.tensor([2, 0, 1])), "cover 3 .* has 4"),
        (
            lambda x, w: dict(group_list=torch.tensor([2, 0, 2]).cumsum(0)[[0, 2, 1]], group_list_type=0),
            "non-decreasing",
        ),
        (lambda x, w: dict(group_list=torch.tensor([2, -1, 3])), "non-negative"),
        (lambda x, w: dict(group_list=torch.tensor([2, 2])), "2 groups"),
        (lambda x, w: dict(output_dtype=torch.float16), "output_dtype"),
        (lambda x, w: dict(bias=[torch.zeros(3)]), "not emulated"),
        (lambda x, w: dict(x=[x.half()]), "dtype"),
        (lambda x, w: dict(x=[x.double()], w=[w.double()]), "dtype"),
        (lambda x, w: dict(x=[x.t().contiguous().t()]), "transposed x is not supported"),
        (lambda x, w: dict(w=[w[:, :, ::2]], x=[x[:, :]]), "weight: only"),
        (lambda x, w: dict(group_type=2), "2-D x and weight"),
    ],
)
def test_emulation_rejects(fake_torch_npu, make, match):
    x, w = torch.randn(4, 6), torch.randn(3, 6, 4)
    kwargs = make(x, w)
    xs, ws = kwargs.pop("x", [x]), kwargs.pop("w", [w])
    args = dict(group_list=torch.tensor([2, 0, 2]), split_item=3, group_type=0, group_list_type=1)
    args.update(kwargs)
    with pytest.raises((NpuOpError, NotImplementedError), match=match):
        fake_torch_npu.npu_grouped_matmul(xs, ws, **args)
    assert fake_torch_npu.calls == []


def test_emulation_rejects_limits(fake_torch_npu):
    ones = torch.ones(MAX_GROUPS + 1, dtype=torch.int64)
    with pytest.raises(NpuOpError, match="at most 1024"):
        gmm(fake_torch_npu, torch.randn(MAX_GROUPS + 1, 2), torch.randn(MAX_GROUPS + 1, 2, 2), ones.tolist())
    (y,) = gmm(fake_torch_npu, torch.randn(MAX_GROUPS, 2), torch.randn(MAX_GROUPS, 2, 2), ones[:-1].tolist())
    assert y.shape == (MAX_GROUPS, 2)
    with pytest.raises(NpuOpError, match="length cannot be 1"):
        gmm(fake_torch_npu, torch.randn(4, 2), torch.randn(1, 2, 3), [4])
    with pytest.raises(NpuOpError, match="inner dim 65536"):
        bf16 = dict(dtype=torch.bfloat16)
        gmm(fake_torch_npu, torch.zeros(2, 65536, **bf16), torch.zeros(2, 65536, 1, **bf16), [1, 1])
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(NpuOpError, match="inner dim 65536"):
        gmm(fake_torch_npu, x, torch.zeros(2, 8, 65536, dtype=torch.bfloat16), [1, 1])
    # A transposed weight's stored last dim is K: N = 65536 passes (the backend is stricter, for dX).
    (y,) = gmm(fake_torch_npu, x, torch.zeros(2, 65536, 8, dtype=torch.bfloat16).transpose(1, 2), [1, 1])
    assert y.shape == (2, 65536) and fake_torch_npu.calls[-1].weight_transposed
    x_TK, dy_TN = torch.randn(5, 3), torch.randn(5, 2)
    with pytest.raises(NpuOpError, match="transposed view"):
        gmm(fake_torch_npu, x_TK.t().contiguous(), dy_TN, [2, 3], group_type=2)
    with pytest.raises(NpuOpError, match="cover 4 along the grouped K axis"):
        gmm(fake_torch_npu, x_TK.t(), dy_TN, [2, 2], group_type=2)


def test_emulation_swiglu(fake_torch_npu):
    x = torch.randn(6, 10)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fake_torch_npu.npu_swiglu(x), F.silu(gate) * up)
    torch.testing.assert_close(fake_torch_npu.npu_swiglu(x, dim=0), F.silu(x[:3]) * x[3:])
    xb = x.bfloat16()
    torch.testing.assert_close(fake_torch_npu.npu_swiglu(xb).float(), F.silu(gate) * up, atol=3e-2, rtol=2e-2)
    with pytest.raises(NpuOpError, match="odd"):
        fake_torch_npu.npu_swiglu(torch.randn(4, 7))
    with pytest.raises(NpuOpError, match="dtype"):
        fake_torch_npu.npu_swiglu(torch.randn(4, 8, dtype=torch.float64))
