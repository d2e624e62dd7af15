"""grouped_mm: every backend against a float64 per-group reference, autograd, validation, the registry."""

import logging

import numpy as np
import pytest
import torch
from host_reads import counting_host_reads
from hypothesis import given, settings
from hypothesis import strategies as st

import epmoe
from epmoe import errors
from epmoe.gmm import GmmBackend, registry, select_backend, unregister_gmm_backend

CPU_BACKENDS = ["batched", "torch", "loop"]


def reference(x, weight, counts, trans_weight):
    """Float64 per-group matmul."""
    w = weight.double().transpose(1, 2) if trans_weight else weight.double()
    out, start = [], 0
    for g, n in enumerate(counts):
        out.append(x[start : start + n].double() @ w[g])
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2]).double()


def offset_view(shape, dtype, offset):
    """A leaf tensor of ``shape`` viewing a flat buffer from element ``offset`` (valid strides; its data
    pointer is 16-byte aligned only if ``offset * itemsize`` is)."""
    numel = torch.Size(shape).numel()
    return torch.randn(numel + offset, dtype=dtype)[offset:].view(shape).detach().requires_grad_()


def check(backend, counts, K=16, N=8, trans_weight=False, dtype=torch.float32, atol=1e-5, x_transposed=False, offset=0):
    T, G = sum(counts), len(counts)
    if x_transposed:
        x = torch.randn(K, T, dtype=dtype).t().requires_grad_()
    else:
        x = offset_view((T, K), dtype, offset)
    shape = (G, N, K) if trans_weight else (G, K, N)
    weight = offset_view(shape, dtype, offset)
    y = epmoe.grouped_mm(x, weight, counts, trans_weight=trans_weight, backend=backend)
    assert y.shape == (T, N) and y.dtype == dtype
    dy = torch.randn(T, N, dtype=dtype)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y64 = reference(x64, w64, counts, trans_weight)
    y64.backward(dy.double())
    rtol = atol
    torch.testing.assert_close(y.double(), y64, atol=atol * K, rtol=rtol)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol * N, rtol=rtol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=atol * max(T, 1), rtol=rtol)
    for g, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(weight.grad[g]) == 0
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("trans_weight", [False, True])
@pytest.mark.parametrize(
    "counts", [[5, 0, 7, 3], [0, 0, 9], [12], [0, 0, 0], [0, 12, 0, 0], [1, 1, 1, 1, 1, 1]], ids=str
)
def test_fp32_against_float64(backend, trans_weight, counts):
    check(backend, counts, trans_weight=trans_weight)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision(backend, dtype, atol):
    check(backend, [30, 0, 17, 40], K=32, N=16, trans_weight=True, dtype=dtype, atol=atol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_x(backend):
    check(backend, [4, 0, 8], x_transposed=True)


@pytest.mark.parametrize("trans_weight", [False, True])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_takes_misaligned_pointers(trans_weight, dtype, atol):
    """The CPU kernel reads any address (torch 2.13): views one element into a buffer stay on `torch`."""
    x, w = offset_view((4, 16), dtype, 1), offset_view((2, 16, 8), dtype, 1)
    assert x.data_ptr() % 16 and w.data_ptr() % 16
    assert select_backend(x, w).name == "torch"
    check("torch", [5, 0, 7, 3], trans_weight=trans_weight, dtype=dtype, atol=atol, offset=1)


def test_cuda_needs_aligned_pointers(monkeypatch):
    """On CUDA the kernel rejects a data pointer that is not 16-byte aligned (CPU tensors stand in)."""
    from epmoe.gmm import torch_gmm

    monkeypatch.setattr(torch_gmm.platform, "device_type", lambda obj=None: "cuda")
    monkeypatch.setattr(torch_gmm.platform, "device_capability", lambda device=None: (9, 0))
    torch_backend = torch_gmm.TorchBackend()
    bf16 = torch.bfloat16
    aligned_x, aligned_w = torch.randn(4, 16, dtype=bf16), torch.randn(2, 16, 8, dtype=bf16)
    assert torch_backend.ineligible_reason(aligned_x, aligned_w) is None
    assert torch_backend.ineligible_reason(offset_view((4, 16), bf16, 1), aligned_w) == (
        "x data pointer is not 16-byte aligned"
    )
    assert torch_backend.ineligible_reason(aligned_x, offset_view((2, 8, 16), bf16, 1), trans_weight=True) == (
        "weight data pointer is not 16-byte aligned"
    )


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    trans_weight=st.booleans(),
    backend=st.sampled_from(CPU_BACKENDS),
)
def test_random_groups(counts, trans_weight, backend):
    check(backend, counts, K=8, N=12, trans_weight=trans_weight)


@pytest.mark.parametrize(
    "make_counts",
    [list, tuple, lambda c: torch.tensor(c), lambda c: torch.tensor(c, dtype=torch.int32), lambda c: list(np.array(c))],
)
def test_counts_forms(make_counts):
    x, w = torch.randn(6, 4), torch.randn(2, 4, 4)
    expected = reference(x, w, [2, 4], False).float()
    torch.testing.assert_close(epmoe.grouped_mm(x, w, make_counts([2, 4])), expected)


@pytest.mark.parametrize("backend, reads", [("torch", 0), ("loop", 2)])
def test_counts_tensor_read_only_where_the_backend_needs_it(backend, reads):
    """A counts tensor reaches a device-counts backend (torch) unread, in forward and backward; a
    host-counts backend (loop) reads it once per op."""
    counts = torch.tensor([2, 0, 4])
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(3, 16, 16, requires_grad=True)
    with counting_host_reads() as calls:
        y = epmoe.grouped_mm(x, w, counts, backend=backend)
        y.backward(torch.ones_like(y))
    assert calls == ["tolist"] * reads
    torch.testing.assert_close(y, reference(x.detach(), w.detach(), [2, 0, 4], False).float())
    assert w.grad[1].abs().max() == 0  # the empty group's gradient is zero


def test_trans_weight_is_not_copied(monkeypatch):
    """The (G, N, K) weight reaches the backend as the caller's storage, never a transposed copy."""
    seen = []

    class Spy(GmmBackend):
        name = "spy"

        def ineligible_reason(self, x, weight, *, trans_weight=False):
            return None

        def forward(self, x_TK, weight, counts, trans_weight):
            seen.append((weight.data_ptr(), trans_weight))
            return registry.LoopBackend().forward(x_TK, weight, counts, trans_weight)

    epmoe.register_gmm_backend(Spy(), before="npu")
    try:
        w = torch.randn(3, 8, 4)
        epmoe.grouped_mm(torch.randn(5, 4), w, [1, 2, 2], trans_weight=True, backend="spy")
        assert seen == [(w.data_ptr(), True)]
    finally:
        unregister_gmm_backend("spy")


@pytest.mark.parametrize(
    "x,w,counts,kwargs,error,match",
    [
        ([[1.0]], torch.randn(1, 1, 1), [1], {}, TypeError, r"grouped_mm\(x\): expected a Tensor"),
        (torch.randn(2, 3), [[1.0]], [2], {}, TypeError, r"grouped_mm\(weight\): expected a Tensor"),
        (torch.randn(2, 3, 1), torch.randn(1, 3, 2), [2], {}, ValueError, r"grouped_mm\(x\): expected a 2-D"),
        (torch.randn(2, 3), torch.randn(3, 2), [2], {}, ValueError, r"grouped_mm\(weight\): expected a 3-D"),
        (torch.randn(2, 3), torch.randn(1, 4, 2), [2], {}, ValueError, r"grouped_mm\(weight\): .* has D=4"),
        (
            torch.randn(2, 3),
            torch.randn(1, 3, 2),
            [2],
            {"trans_weight": True},
            ValueError,
            r"grouped_mm\(weight\): .* has D=2",
        ),
        (torch.randn(2, 3), torch.randn(1, 3, 2).double(), [2], {}, ValueError, r"grouped_mm\(weight\): dtype"),
        (
            torch.ones(2, 3, dtype=torch.int64),
            torch.ones(1, 3, 2, dtype=torch.int64),
            [2],
            {},
            ValueError,
            r"grouped_mm\(x\): expected a floating dtype",
        ),
        (torch.randn(2, 3), torch.randn(2, 3, 2), [2], {}, ValueError, r"grouped_mm\(counts\): 1 counts for 2 groups"),
        (torch.randn(2, 3), torch.randn(2, 3, 2), [3, -1], {}, ValueError, r"grouped_mm\(counts\): .*non-negative"),
        (torch.randn(2, 3), torch.randn(2, 3, 2), [1, 2], {}, ValueError, r"grouped_mm\(counts\): counts sum to 3"),
        (torch.randn(2, 3), torch.randn(2, 3, 2), [1.0, 1.0], {}, TypeError, r"grouped_mm\(counts\): expected ints"),
        (torch.randn(2, 3), torch.randn(2, 3, 2), [True, 1], {}, TypeError, r"grouped_mm\(counts\): expected ints"),
        (
            torch.randn(2, 3),
            torch.randn(2, 3, 2),
            torch.tensor([1.0, 1.0]),
            {},
            TypeError,
            r"grouped_mm\(counts\): expected an integer tensor",
        ),
        (torch.randn(2, 3), torch.randn(2, 3, 2), "11", {}, TypeError, r"grouped_mm\(counts\): expected a sequence"),
        (
            torch.randn(2, 3),
            torch.randn(2, 3, 2),
            [1, 1],
            {"trans_weight": 1},
            TypeError,
            r"grouped_mm\(trans_weight\): expected a bool",
        ),
        (
            torch.randn(2, 3),
            torch.randn(2, 3, 2),
            [1, 1],
            {"backend": "nope"},
            ValueError,
            r"grouped_mm\(backend\): unknown backend 'nope'",
        ),
        (
            torch.randn(2, 3),
            torch.randn(2, 3, 2),
            [1, 1],
            {"backend": 1},
            TypeError,
            r"grouped_mm\(backend\): expected a str",
        ),
    ],
)
def test_validation(x, w, counts, kwargs, error, match):
    with pytest.raises(error, match=match):
        epmoe.grouped_mm(x, w, counts, **kwargs)


def test_torch_backend_reasons():
    torch_backend = next(b for b in registry._registry if b.name == "torch")
    assert torch_backend.ineligible_reason(torch.randn(4, 8), torch.randn(2, 8, 4)) is None
    assert "16 bytes" in torch_backend.ineligible_reason(torch.randn(4, 6), torch.randn(2, 6, 4))
    assert "16 bytes" in torch_backend.ineligible_reason(
        torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(2, 8, 4, dtype=torch.bfloat16)
    )
    # an output width the backward kernels cannot take (dy is (T, N)) is declined up front
    assert "output width N=3" in torch_backend.ineligible_reason(
        torch.randn(6, 16), torch.randn(2, 3, 16), trans_weight=True
    )
    assert "dtype" in torch_backend.ineligible_reason(torch.randn(4, 8).double(), torch.randn(2, 8, 4).double())


def test_named_backend_that_declines_raises():
    with pytest.raises(ValueError, match="backend='torch'.*16 bytes"):
        epmoe.grouped_mm(torch.randn(4, 6), torch.randn(2, 6, 4), [2, 2], backend="torch")
    with pytest.raises(ValueError, match="backend='npu'.*torch_npu"):
        epmoe.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), [2, 2], backend="npu")


def test_env_forces_backend(monkeypatch):
    monkeypatch.setenv("EPMOE_GMM_BACKEND", "loop")
    assert select_backend(torch.randn(4, 8), torch.randn(2, 8, 4)).name == "loop"
    assert select_backend(torch.randn(4, 8), torch.randn(2, 8, 4), backend="torch").name == "loop"
    monkeypatch.setenv("EPMOE_GMM_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"grouped_mm\(\$EPMOE_GMM_BACKEND\): unknown backend 'bogus'"):
        epmoe.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), [2, 2])


def test_select_backend_validates_like_grouped_mm(monkeypatch, caplog):
    """A bad operand raises naming it, before any backend is judged or any fallback is logged."""
    monkeypatch.setattr(errors, "_said", set())
    with pytest.raises(TypeError, match=r"select_backend\(x\): expected a Tensor"):
        select_backend([[1.0]], torch.randn(2, 1, 4))
    with caplog.at_level(logging.INFO, logger="epmoe.gmm.registry"):
        with pytest.raises(ValueError, match=r"select_backend\(weight\): .* has D=6, but x has D=8"):
            select_backend(torch.randn(4, 8), torch.randn(2, 6, 4))
        with pytest.raises(ValueError, match=r"gmm_backends\(weight\): .* has D=6, but x has D=8"):
            epmoe.gmm_backends(torch.randn(4, 8), torch.randn(2, 6, 4))
    assert caplog.records == [] and errors._said == set()


@pytest.mark.parametrize(
    "make_x,torch_eligible",
    [
        (lambda: torch.randn(5, 8)[:, :6], False),  # padded rows: fine as given, not once contiguous
        (lambda: torch.randn(5, 16)[:, ::2], True),
    ],  # no unit stride as given, fine once contiguous
    ids=["padded", "strided"],
)
def test_non_contiguous_x_judged_as_grouped_mm_passes_it(make_x, torch_eligible):
    x = make_x()
    w = torch.randn(2, x.shape[1], 4)
    statuses = {s.name: s for s in epmoe.gmm_backends(x, w)}
    assert statuses["torch"].eligible == torch_eligible
    assert select_backend(x, w).name == ("torch" if torch_eligible else "loop")
    if not torch_eligible:
        assert statuses["torch"].reason.startswith(f"x stride {x.shape[1]}")
    torch.testing.assert_close(epmoe.grouped_mm(x, w, [2, 3]), reference(x, w, [2, 3], False).float())


def test_gmm_backends_for_judges_every_call():
    x8, w8 = torch.randn(0, 8), torch.randn(2, 8, 8)
    x6, w6 = torch.randn(0, 6), torch.randn(2, 6, 8)
    statuses = {s.name: s for s in registry.gmm_backends_for({"up": (x8, w8, False), "down": (x6, w6, False)})}
    assert not statuses["torch"].eligible and statuses["torch"].reason.startswith("down: x stride 6")
    assert statuses["loop"].eligible
    assert all(s.eligible for s in registry.gmm_backends_for({}))
    with pytest.raises(ValueError, match=r"gmm_backends_for\['down'\]\(weight\): .* has D=8, but x has D=6"):
        registry.gmm_backends_for({"up": (x8, w8, False), "down": (x6, w8, False)})


def test_gmm_backends_lists_every_backend():
    statuses = epmoe.gmm_backends(torch.randn(4, 6), torch.randn(2, 6, 4))
    assert [s.name for s in statuses] == ["npu", "batched", "torch", "loop"]
    assert [s.eligible for s in statuses] == [False, True, False, True]
    assert statuses[0].reason == "torch_npu is not installed"
    assert statuses[1].reason is None and statuses[3].reason is None


def test_fallback_warns_once_and_info_once(monkeypatch, caplog):
    monkeypatch.setattr(errors, "_said", set())
    with caplog.at_level(logging.INFO, logger="epmoe.gmm.registry"):
        for _ in range(3):
            epmoe.grouped_mm(torch.randn(4, 6), torch.randn(2, 6, 4), [2, 2])
            epmoe.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), [2, 2])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1
    assert "'loop'" in warnings[0].message and "npu: torch_npu is not installed" in warnings[0].message
    assert "torch: x stride 6" in warnings[0].message
    assert len(infos) == 1 and "'torch'" in infos[0].message


def test_register_backend_order_and_validation():
    class Fast(GmmBackend):
        name = "fast"

        def ineligible_reason(self, x, weight, *, trans_weight=False):
            return "never"

    epmoe.register_gmm_backend(Fast())
    try:
        assert [s.name for s in epmoe.gmm_backends()] == ["npu", "batched", "torch", "fast", "loop"]
        epmoe.register_gmm_backend(Fast(), before="npu")
        assert [s.name for s in epmoe.gmm_backends()] == ["fast", "npu", "batched", "torch", "loop"]
    finally:
        unregister_gmm_backend("fast")
    with pytest.raises(TypeError, match=r"register_gmm_backend\(backend\)"):
        epmoe.register_gmm_backend(object())
    with pytest.raises(ValueError, match=r"register_gmm_backend\(before\): no backend named 'missing'"):
        epmoe.register_gmm_backend(Fast(), before="missing")


def test_auto_takes_batched_only_for_small_even_groups_in_a_forward():
    """``batched`` pays only for many small, even groups in an undifferentiated forward: auto takes it
    there (from the call's counts), passes over it elsewhere, in a differentiated call and without
    counts; named, it runs any counts."""
    from epmoe.gmm.batched import WINS

    min_groups, max_mean, max_spread = WINS["cpu"]
    G, K, N = min_groups, 16, 8
    x, w = torch.randn(G * max_mean // 2, K), torch.randn(G, K, N)
    even = [max_mean // 2] * G
    skewed = [0] * (G - 1) + [G * max_mean // 2]
    assert select_backend(x, w, counts=even, backward=False).name == "batched"
    assert select_backend(x, w, counts=even, backward=True).name == "torch"
    assert select_backend(x, w, counts=skewed, backward=False).name == "torch"
    assert select_backend(x, w).name == "torch"  # no counts: never by_counts
    few = [max_mean // 2] * (min_groups - 1)
    assert select_backend(x[: sum(few)], w[: len(few)], counts=few, backward=False).name == "torch"
    batched = next(b for b in registry._registry if b.name == "batched")
    assert "x the mean" in batched.counts_reason(skewed, x, backward=False)
    assert "groups" in batched.counts_reason(few, x, backward=False)
    assert "differentiated" in batched.counts_reason(even, x, backward=True)
    assert "on meta" in batched.counts_reason(even, torch.empty(0, device="meta"), backward=False)
    with torch.no_grad():  # grouped_mm itself: an undifferentiated call on even groups runs batched
        chosen = []
        original = batched.forward
        batched.forward = lambda *a: chosen.append("batched") or original(*a)
        try:
            y = epmoe.grouped_mm(x, w, even)
        finally:
            del batched.forward
    assert chosen == ["batched"]
    torch.testing.assert_close(y.double(), reference(x, w, even, False), atol=1e-4, rtol=1e-5)
    y = epmoe.grouped_mm(x, w, skewed, backend="batched")  # named: runs where auto would not
    torch.testing.assert_close(y.double(), reference(x, w, skewed, False), atol=1e-4, rtol=1e-5)


def test_a_preferred_backend_runs_where_it_takes_the_call_else_auto_chooses():
    """``prefer:NAME`` (documented in grouped_mm; epmoe's own callers pass a BackendChoice or a
    GmmBackend instead): NAME where it takes the operands, the usual choice where it declines them
    (a named backend would raise)."""
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    expected = epmoe.grouped_mm(x, w, [2, 4], backend="loop")
    assert select_backend(x, w, backend="prefer:loop", counts=[2, 4]).name == "loop"
    assert select_backend(x, w, backend="prefer:npu", counts=[2, 4]).name == select_backend(x, w, counts=[2, 4]).name
    torch.testing.assert_close(epmoe.grouped_mm(x, w, [2, 4], backend="prefer:npu"), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="declines"):
        epmoe.grouped_mm(x, w, [2, 4], backend="npu")


def test_zero_groups_on_auto():
    """No groups at all (an empty weight stack): every backend's answer is the empty (0, N) output."""
    out = epmoe.grouped_mm(torch.zeros(0, 16), torch.zeros(0, 16, 8), [])
    assert out.shape == (0, 8)


def test_a_backend_choice_judges_again_only_where_the_operands_differ(monkeypatch):
    """grouped_mm(backend=BackendChoice): judged once for its operands (forward and backward, any row
    count), again once for operands that differ (here: a data pointer off the 16-byte grid)."""
    asked = []
    torch_backend = next(b for b in registry._registry if b.name == "torch")
    judge = torch_backend.ineligible_reason

    def counted(x, w, *, trans_weight=False):
        asked.append(x.shape)
        return judge(x, w, trans_weight=trans_weight)

    monkeypatch.setattr(torch_backend, "ineligible_reason", counted)
    choice = registry.BackendChoice("auto")
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(2, 8, 4, requires_grad=True)
    epmoe.grouped_mm(x, w, [2, 4], backend=choice).sum().backward()
    epmoe.grouped_mm(torch.randn(5, 8), w, torch.tensor([1, 4]), backend=choice)
    assert len(asked) == 1
    shifted = torch.randn(6 * 8 + 1)[1:].view(6, 8)
    assert registry.Operands.of(shifted, w, False) != registry.Operands.of(x, w, False)
    y = epmoe.grouped_mm(shifted, w, [2, 4], backend=choice)
    epmoe.grouped_mm(shifted, w, [3, 3], backend=choice)
    assert len(asked) == 2
    torch.testing.assert_close(y, epmoe.grouped_mm(shifted.clone(), w, [2, 4], backend="loop"))
    with pytest.raises(TypeError, match=r"grouped_mm\(backend\): expected a str or a BackendChoice"):
        epmoe.grouped_mm(x, w, [2, 4], backend=torch_backend)


def test_an_ops_backend_is_one_lookup_unless_the_counts_may_decide(monkeypatch):
    """BackendChoice.backend_for_weights (what epmoe::routed_mlp asks each time it runs): chosen once
    per weights' operands and then looked up, without choose_backend, in a differentiated call (no
    counts can make auto take batched); chosen per call, from its counts, where they can (inference on
    the CPU), and under a changed $EPMOE_GMM_BACKEND."""
    from epmoe.gmm.batched import WINS

    min_groups, max_mean, _ = WINS["cpu"]
    up, down = torch.randn(min_groups, 16, 8), torch.randn(min_groups, 8, 16)
    even = [max_mean // 2] * min_groups
    skewed = [0] * (min_groups - 1) + [min_groups * max_mean // 2]
    choice = registry.BackendChoice("auto")
    chosen = []
    choose = registry.choose_backend
    monkeypatch.setattr(registry, "choose_backend", lambda *a, **k: chosen.append(1) or choose(*a, **k))
    for counts in (even, skewed, even):
        assert choice.backend_for_weights((up, down), False, counts=counts, backward=True).name == "torch"
    assert len(chosen) == 1  # chosen once, then looked up
    assert choice.backend_for_weights((up, down), False, counts=even, backward=False).name == "batched"
    assert choice.backend_for_weights((up, down), False, counts=skewed, backward=False).name == "torch"
    assert len(chosen) == 3  # the counts decide: per call
    monkeypatch.setenv("EPMOE_GMM_BACKEND", "loop")
    assert choice.backend_for_weights((up, down), False, counts=even, backward=False).name == "loop"
    assert choice.backend_for_weights((up, down), False, counts=even, backward=False).name == "loop"
    assert len(chosen) == 4  # a named backend: the counts cannot change it
