"""alltoallv_gmm / gmm_alltoallv on real gloo ranks: layouts, agreement with the reference, gradients.

Multi-rank checks run in one spawned group per world size (spawning costs seconds): each worker runs
its named checks in order and reports ``"ok"`` or the traceback of the first failure, and one test
per check reads that report. Counts come from a routing matrix ``A[s][r*e + j]`` (rows rank ``s``
sends to rank ``r``'s expert ``j``) that every rank builds from the same seed.
"""

from __future__ import annotations

import os
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from npu_fused_emulation import EmulatedTorchNpu, FusedOpError
from ranks import start_ranks

import epmoe
from epmoe import platform
from epmoe.comm.fused import npu as fused_npu
from epmoe.comm.layout import RowLayout, round_bounds

F64 = torch.float64
SCENARIOS = ("zeros", "sender_empty", "receiver_empty")


# ---------------------------------------------------------------------------------------------
# routing and one MoE expert block (dispatch -> tanh -> combine) with every output in the loss
# ---------------------------------------------------------------------------------------------


def routing(world: int, e: int, scenario: str, seed: int = 0) -> list[list[int]]:
    """``A[s][r*e + j]``: random counts with zero blocks; optionally an idle sender or receiver."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randint(0, 4, (world, world * e), generator=g)
    A[A == 1] = 0
    if scenario == "sender_empty":
        A[world - 1] = 0
    elif scenario == "receiver_empty":
        A[:, :e] = 0  # nothing is routed to rank 0's experts
    return A.tolist()


def counts_of(A: list[list[int]], rank: int, e: int) -> tuple[list[int], list[int]]:
    world = len(A)
    return list(A[rank]), [A[s][rank * e + j] for s in range(world) for j in range(e)]


def make_inputs(rank, A, e, trans, shared, *, seed=0, H=4, F=3, shared_rows=(5, 2)):
    """``(send, recv, trans, tensors)``: this rank's inputs, weights and output cotangents (float64)."""
    send, recv = counts_of(A, rank, e)
    g = torch.Generator().manual_seed(1000 * seed + rank)

    def randn(*shape):
        return torch.randn(*shape, dtype=F64, generator=g)

    t = {
        "x": randn(sum(send), H),
        "w1": randn(e, F, H) if trans else randn(e, H, F),
        "w2": randn(e, H, F) if trans else randn(e, F, H),
        "cy": randn(sum(recv), F),
        "cp": randn(sum(recv), H),
        "cz": randn(sum(send), H),
    }
    if shared:
        rows1, rows2 = shared_rows
        t.update(
            sx1=randn(rows1, H),
            sw1=randn(F, H) if trans else randn(H, F),
            cs1=randn(rows1, F),
            sx2=randn(rows2, F),
            sw2=randn(H, F) if trans else randn(F, H),
            cs2=randn(rows2, H),
        )
    return send, recv, trans, t


def run_block(inputs, impl, num_chunks, *, return_permuted=True, x_grad=True):
    """Outputs and gradients of dispatch -> tanh -> combine, every output weighted in the loss."""
    send, recv, trans, t = inputs
    names = [n for n in ("x", "w1", "w2", "sx1", "sw1", "sx2", "sw2") if n in t and (x_grad or n != "x")]
    leaves = {n: t[n].clone().requires_grad_() for n in names}
    x = leaves.get("x", t["x"])
    shared = "sx1" in t
    y, sy, p = epmoe.alltoallv_gmm(
        x,
        leaves["w1"],
        send,
        recv,
        trans_weight=trans,
        return_permuted=return_permuted,
        shared_x=leaves.get("sx1"),
        shared_weight=leaves.get("sw1"),
        trans_shared_weight=trans,
        num_chunks=num_chunks,
        impl=impl,
    )
    z, sz = epmoe.gmm_alltoallv(
        torch.tanh(y),
        leaves["w2"],
        recv,
        send,
        trans_weight=trans,
        shared_x=leaves.get("sx2"),
        shared_weight=leaves.get("sw2"),
        trans_shared_weight=trans,
        num_chunks=num_chunks,
        impl=impl,
    )
    assert (sy is None) == (not shared) and (sz is None) == (not shared)
    assert (p is None) == (not return_permuted)
    loss = (z * t["cz"]).sum() + (y * t["cy"]).sum()
    if return_permuted:
        loss = loss + (p * t["cp"]).sum()
    if shared:
        loss = loss + (sy * t["cs1"]).sum() + (sz * t["cs2"]).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    outputs = {"y": y, "z": z, "permuted": p, "shared_y1": sy, "shared_y2": sz}
    outputs.update({f"d{n}": gr for n, gr in zip(names, grads)})
    return {k: v for k, v in outputs.items() if v is not None}


def assert_same(got, want, label):
    assert got.keys() == want.keys(), (label, sorted(got), sorted(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m: f"{label} {key}: {m}")


def check_agreement(rank, world, cases):
    """pipelined (every num_chunks given), auto: identical to the reference in outputs and gradients."""
    for e, scenario, trans, shared, chunk_list in cases:
        inputs = make_inputs(rank, routing(world, e, scenario), e, trans, shared)
        want = run_block(inputs, "reference", 1)
        for chunks in chunk_list:
            label = f"W={world} e={e} {scenario} trans={trans} shared={shared} chunks={chunks}"
            assert_same(run_block(inputs, "pipelined", chunks), want, label)
        assert_same(run_block(inputs, "auto", "auto"), want, f"auto e={e} {scenario}")


# ---------------------------------------------------------------------------------------------
# multi-rank checks
# ---------------------------------------------------------------------------------------------


def _full_matrix(rank, world):
    cases = [
        (e, s, trans, shared, list(range(1, e + 1)))
        for e in (1, 2, 3)
        for s in SCENARIOS
        for trans in (False, True)
        for shared in (False, True)
    ]
    check_agreement(rank, world, cases)


def _small_matrix(rank, world):
    cases = [(e, s, trans, trans, [1, e, e + 5]) for e in (1, 2) for s in SCENARIOS for trans in (False, True)]
    check_agreement(rank, world, cases)


def _special_paths(rank, world):
    """Input without grad (local dW), no permuted output, num_chunks beyond e, exchange_counts."""
    for scenario in SCENARIOS:
        A = routing(world, 3, scenario)
        assert epmoe.exchange_counts(torch.tensor(A[rank])) == counts_of(A, rank, 3)
        inputs = make_inputs(rank, A, 3, False, True)
        for kwargs in ({"x_grad": False}, {"return_permuted": False}):
            want = run_block(inputs, "reference", 1, **kwargs)
            for chunks in (1, 2, 7):
                assert_same(run_block(inputs, "pipelined", chunks, **kwargs), want, f"{scenario} {kwargs}")


def _layout_pin(rank, world):
    """The worked example of the reference notes (W=2, e=2), written out by hand."""
    A = [
        [1, 1, 1, 1],  # rank 0 routes rows 100 -> (0,0); 101 -> (0,1); 102 -> (1,0); 103 -> (1,1)
        [1, 2, 0, 1],
    ]  # rank 1 routes rows 200 -> (0,0); 201, 202 -> (0,1); 203 -> (1,1)
    send, recv = counts_of(A, rank, 2)
    assert recv == ([1, 1, 1, 2] if rank == 0 else [1, 1, 0, 1])  # source-rank-major
    x = torch.tensor([100.0, 101.0, 102.0, 103.0] if rank == 0 else [200.0, 201.0, 202.0, 203.0], dtype=F64)[:, None]
    scale = torch.tensor([[[rank * 2 + 1.0]], [[rank * 2 + 2.0]]], dtype=F64)  # global expert g scales by g+1
    # expert-major (j, s): rank 0 gets [j0: 100 from s0, 200 from s1][j1: 101 from s0, 201 202 from s1]
    expected_permuted = [100, 200, 101, 201, 202] if rank == 0 else [102, 103, 203]
    expected_y = [100, 200, 202, 402, 404] if rank == 0 else [306, 412, 812]
    expected_back = [100, 202, 306, 412] if rank == 0 else [200, 402, 404, 812]  # rank-major, input order
    for impl, chunks in (("reference", 1), ("pipelined", 1), ("pipelined", 2)):
        y, _, permuted = epmoe.alltoallv_gmm(x, scale, send, recv, return_permuted=True, num_chunks=chunks, impl=impl)
        assert permuted.flatten().tolist() == expected_permuted, (impl, chunks, permuted.flatten().tolist())
        assert y.flatten().tolist() == expected_y, (impl, chunks, y.flatten().tolist())
        back, _ = epmoe.gmm_alltoallv(permuted, scale, recv, send, num_chunks=chunks, impl=impl)
        assert back.flatten().tolist() == expected_back, (impl, chunks, back.flatten().tolist())


def _round_trip(rank, world):
    """Dispatch then combine with identity weights returns every rank's input, in order."""
    for e in (1, 3):
        for scenario in SCENARIOS:
            A = routing(world, e, scenario, seed=5)
            send, recv = counts_of(A, rank, e)
            x = torch.randn(sum(send), 6, dtype=F64)
            eye = torch.eye(6, dtype=F64).expand(e, 6, 6)
            for impl, chunks in (("reference", 1), ("pipelined", 1), ("pipelined", e)):
                y, _, _ = epmoe.alltoallv_gmm(x, eye, send, recv, num_chunks=chunks, impl=impl)
                back, _ = epmoe.gmm_alltoallv(y, eye, recv, send, trans_weight=True, num_chunks=chunks, impl=impl)
                assert torch.equal(back, x), (e, scenario, impl, chunks)


def _no_collective(*tensors, **kwargs):
    """Booby trap for the collectives that move rows; the agreement step (int64 step headers, in which
    a rank that rejected its input tells its peers) passes."""
    if not all(t.dtype == torch.int64 for t in tensors if isinstance(t, torch.Tensor)):
        raise AssertionError("rows were exchanged before validation finished")
    return _saved_collectives[0](*tensors, **kwargs)


_saved_collectives = []


def _no_reduction(*args, **kwargs):
    raise AssertionError("a reduction was issued before validation finished")


def _bad_input(rank, world):
    """Every rank raises before any rows move (their collectives are booby-trapped meanwhile): only
    the agreement step runs."""
    e = 2
    send, recv = counts_of(routing(world, e, "zeros", seed=3), rank, e)
    w = torch.randn(e, 4, 3, dtype=F64)
    sx, sw = torch.randn(2, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    bad = [
        (ValueError, "send_counts", lambda a: dict(send_counts=a["send_counts"] + [0])),
        (ValueError, "recv_counts", lambda a: dict(recv_counts=a["recv_counts"][:-1])),
        (ValueError, "send_counts", lambda a: dict(send_counts=[c + 1 for c in a["send_counts"]])),
        (ValueError, "recv_counts", lambda a: dict(recv_counts=[-1] + a["recv_counts"][1:])),
        (TypeError, "send_counts", lambda a: dict(send_counts=[float(c) for c in a["send_counts"]])),
        (ValueError, "weight", lambda a: dict(weight=w.float())),
        (ValueError, "weight", lambda a: dict(weight=torch.randn(e, 5, 3, dtype=F64))),
        (ValueError, "send_counts", lambda a: dict(weight=torch.randn(e + 1, 4, 3, dtype=F64))),
        (ValueError, "shared_x", lambda a: dict(shared_x=sx.float(), shared_weight=sw)),
        (ValueError, "shared_weight", lambda a: dict(shared_x=sx, shared_weight=torch.randn(3, 5, dtype=F64))),
        (ValueError, "shared_x, shared_weight", lambda a: dict(shared_x=sx)),
        (ValueError, "num_chunks", lambda a: dict(num_chunks=0)),
        (ValueError, "num_chunks", lambda a: dict(num_chunks="fast")),
        (ValueError, "impl", lambda a: dict(impl="fastest")),
        (ValueError, "impl", lambda a: dict(impl="npu_fused")),
        (TypeError, "trans_weight", lambda a: dict(trans_weight=1)),
    ]
    dispatch_args = dict(x=torch.randn(sum(send), 4, dtype=F64), weight=w, send_counts=send, recv_counts=recv)
    combine_args = dict(x=torch.randn(sum(recv), 4, dtype=F64), weight=w, send_counts=recv, recv_counts=send)
    saved = dist.all_to_all_single, dist.all_reduce
    _saved_collectives[:] = [dist.all_to_all_single]
    dist.all_to_all_single, dist.all_reduce = _no_collective, _no_reduction
    try:
        for op, base in ((epmoe.alltoallv_gmm, dispatch_args), (epmoe.gmm_alltoallv, combine_args)):
            for error, name, change in bad:
                with pytest.raises(error, match=re.escape(f"{op.__name__}({name}")):
                    op(**{**base, **change(base)})
    finally:
        dist.all_to_all_single, dist.all_reduce = saved
    y, _, _ = epmoe.alltoallv_gmm(**dispatch_args, num_chunks=2)  # the group is still in step
    assert y.shape == (sum(recv), 3)


class _ThisRanks(torch.autograd.Function):
    """``(W, ...)`` tensor of every rank's values -> this rank's slice; the gradient sums all ranks'."""

    @staticmethod
    def forward(ctx, every_rank):
        ctx.shape = every_rank.shape
        return every_rank[dist.get_rank()].clone()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        full[dist.get_rank()] = grad
        dist.all_reduce(full)
        return full


class _EveryRanks(torch.autograd.Function):
    """This rank's tensor -> ``(W, ...)`` every rank's; the cotangent is the same on every rank."""

    @staticmethod
    def forward(ctx, local):
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local.contiguous())
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad[dist.get_rank()]


def _gradcheck_gloo(rank, world):
    """gradcheck of the global function (every rank's inputs -> every rank's outputs), the same on all ranks.

    Every rank holds every rank's inputs and perturbs the same element at the same time; only the
    owner uses it. Local shapes are equal on all ranks so the gathers stack.
    """
    A = [[1, 0, 1, 1], [0, 2, 1, 0]]
    send, recv = counts_of(A, rank, 2)
    _gradcheck_ops(send, recv, world, _ThisRanks.apply, _EveryRanks.apply)


def _gradcheck_ops(send, recv, world=1, this_rank=lambda t: t[0], every_rank=lambda t: t.unsqueeze(0)):
    g = torch.Generator().manual_seed(11)

    def leaf(*shape):
        return torch.randn(world, *shape, dtype=F64, generator=g).requires_grad_()

    rows_in, rows_out = sum(send), sum(recv)
    x, w, sx, sw = leaf(rows_in, 2), leaf(2, 2, 3), leaf(2, 2), leaf(2, 3)
    h, wt, swt = leaf(rows_out, 3), leaf(2, 2, 3), leaf(3, 2)
    for chunks in (1, 2):

        def dispatch(x, w, sx, sw):
            outs = epmoe.alltoallv_gmm(
                this_rank(x),
                this_rank(w),
                send,
                recv,
                shared_x=this_rank(sx),
                shared_weight=this_rank(sw),
                return_permuted=True,
                num_chunks=chunks,
                impl="pipelined",
            )
            return tuple(every_rank(t) for t in outs)

        def combine(h, wt, sx, swt):
            outs = epmoe.gmm_alltoallv(
                this_rank(h),
                this_rank(wt),
                recv,
                send,
                trans_weight=True,
                shared_x=this_rank(sx),
                shared_weight=this_rank(swt),
                trans_shared_weight=True,
                num_chunks=chunks,
                impl="pipelined",
            )
            return tuple(every_rank(t) for t in outs)

        assert torch.autograd.gradcheck(dispatch, (x, w, sx, sw))
        assert torch.autograd.gradcheck(combine, (h, wt, sx, swt))


def _with_emulated_npu(fn):
    """Run ``fn(emu)`` with the npu_fused path routed to :class:`EmulatedTorchNpu` (float64 allowed)."""
    emu = EmulatedTorchNpu(
        world_sizes=(2,), dtypes=(torch.float16, torch.bfloat16, F64), min_peer_bytes=128, max_peer_bytes=4096
    )
    names = ("device_reason", "hcom_name", "SUPPORTED_EP_SIZES", "DTYPES", "MIN_PEER_BYTES", "MAX_PEER_BYTES")
    saved = {n: getattr(fused_npu, n) for n in names}
    saved_torch_npu = platform.torch_npu
    platform.torch_npu = lambda: emu
    fused_npu.device_reason = lambda x: None
    fused_npu.hcom_name = emu.register
    fused_npu.SUPPORTED_EP_SIZES, fused_npu.DTYPES = emu.world_sizes, emu.dtypes
    fused_npu.MIN_PEER_BYTES, fused_npu.MAX_PEER_BYTES = emu.min_peer_bytes, emu.max_peer_bytes
    try:
        fn(emu)
    finally:
        platform.torch_npu = saved_torch_npu
        for n, value in saved.items():
            setattr(fused_npu, n, value)


def _npu_emulated(rank, world):
    """The npu_fused path against the emulated ops: same numbers, mirror op as backward."""
    A = [[2, 1, 3, 2], [1, 2, 2, 3]]  # 8 rows (64 B each at width 8) per rank; >= 2 rows per peer
    send, recv = counts_of(A, rank, 2)

    def inputs(trans, shared, H=8, F=8):
        return make_inputs(rank, A, 2, trans, shared, H=H, F=F, shared_rows=(4, 4))

    def run(emu):
        for trans, shared, fuse_env in ((False, False, "0"), (True, True, "0"), (False, True, "1")):
            os.environ[fused_npu.ENV_FUSE_SHARED] = fuse_env
            data = inputs(trans, shared)
            want = run_block(data, "reference", 1, return_permuted=False)
            emu.calls.clear()
            got = run_block(data, "npu_fused", 1, return_permuted=False)
            assert_same(got, want, f"npu trans={trans} shared={shared}")
            ops = [(c.op, c.send_counts, c.recv_counts, c.trans_gmm_weight, c.with_mm) for c in emu.calls]
            with_mm = shared and fuse_env == "1"
            assert ops == [
                ("npu_alltoallv_gmm", send, recv, trans, with_mm),  # dispatch forward
                ("npu_gmm_alltoallv", recv, send, trans, with_mm),  # combine forward
                ("npu_alltoallv_gmm", send, recv, not trans, False),  # combine backward: mirror, W^T
                ("npu_gmm_alltoallv", recv, send, not trans, False),  # dispatch backward: mirror, W^T
            ], ops
            assert emu.calls[0].permute_out_flag and emu.calls[2].permute_out_flag  # dW from permute_out
        os.environ.pop(fused_npu.ENV_FUSE_SHARED)

        # gradient into `permuted` must join before the exchange: that backward runs pipelined
        data = inputs(False, False)
        emu.calls.clear()
        assert_same(run_block(data, "auto", 1), run_block(data, "reference", 1), "npu with permuted")
        assert [c.op for c in emu.calls] == ["npu_alltoallv_gmm", "npu_gmm_alltoallv", "npu_alltoallv_gmm"]

        # volume counted with the input width: with F=1, the runs whose input is F wide (combine
        # forward, dispatch backward) fall below the minimum, those whose input is H wide do not
        data = inputs(False, False, F=1)
        emu.calls.clear()
        assert_same(
            run_block(data, "auto", 1, return_permuted=False),
            run_block(data, "reference", 1, return_permuted=False),
            "npu narrow",
        )
        ops = [(c.op, c.trans_gmm_weight) for c in emu.calls]
        assert ops == [("npu_alltoallv_gmm", False), ("npu_alltoallv_gmm", True)], ops

        # bf16 (the real dtypes) against the float64 reference
        data = inputs(False, True, H=32, F=32)
        low = (data[0], data[1], data[2], {k: v.bfloat16() for k, v in data[3].items()})
        got = run_block(low, "npu_fused", 1, return_permuted=False)
        want = run_block(
            (data[0], data[1], data[2], {k: v.bfloat16().double() for k, v in data[3].items()}),
            "reference",
            1,
            return_permuted=False,
        )
        for key in want:
            torch.testing.assert_close(got[key].double(), want[key], rtol=0.05, atol=0.3, msg=key)

        # agreement: only rank 0 sees its own small self-block, every rank must leave the fused path
        skewed = [[1, 0, 3, 2], [1, 2, 2, 3]]
        s, r = counts_of(skewed, rank, 2)
        x, w = torch.randn(sum(s), 8, dtype=F64), torch.randn(2, 8, 8, dtype=F64)
        emu.calls.clear()
        y, _, _ = epmoe.alltoallv_gmm(x, w, s, r, impl="auto")
        assert emu.calls == [] and y.shape == (sum(r), 8)
        with pytest.raises(ValueError, match="npu_fused" if rank == 0 else "another rank"):
            epmoe.alltoallv_gmm(x, w, s, r, impl="npu_fused")
        if rank == 0:  # the emulation rejects what the eligibility rejects (before communicating)
            with pytest.raises(FusedOpError, match="volume"):
                emu.npu_alltoallv_gmm(x, w, emu.register(None), 2, s, r)

    _with_emulated_npu(run)


def _run_checks(rank, world, names):
    report = {}
    for name in names:
        try:
            CHECKS[name](rank, world)
            report[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test of that check
            report[name] = traceback.format_exc()
            break
    return report


CHECKS = {
    "full_matrix": _full_matrix,
    "small_matrix": _small_matrix,
    "special_paths": _special_paths,
    "layout_pin": _layout_pin,
    "round_trip": _round_trip,
    "bad_input": _bad_input,
    "gradcheck_gloo": _gradcheck_gloo,
    "npu_emulated": _npu_emulated,
}
RUNS = {
    2: ["layout_pin", "bad_input", "round_trip", "full_matrix", "special_paths", "gradcheck_gloo", "npu_emulated"],
    3: ["round_trip", "small_matrix", "special_paths"],
    4: ["small_matrix"],
}


@pytest.fixture(scope="module")
def reports():
    return lambda world: start_ranks(_run_checks, world, RUNS[world], timeout=240, once=True)


@pytest.mark.multirank
@pytest.mark.parametrize("world,check", [(w, c) for w, names in RUNS.items() for c in names])
def test_multi_rank(reports, world, check):
    for rank, report in enumerate(reports(world)):
        assert report.get(check) == "ok", f"rank {rank}: {report.get(check, 'not run: an earlier check failed')}"


# ---------------------------------------------------------------------------------------------
# a group of one (no process group), eligibility, layout helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trans,shared", [(False, False), (True, True)])
def test_group_of_one_matches_reference(trans, shared):
    inputs = make_inputs(0, routing(1, 3, "zeros"), 3, trans, shared)
    want = run_block(inputs, "reference", 1)
    for chunks in (1, 2, 3, "auto"):
        assert_same(run_block(inputs, "pipelined", chunks), want, f"chunks={chunks}")


def test_gradcheck_group_of_one():
    _gradcheck_ops([2, 1], [2, 1])


def test_validation_without_process_group():
    x, w = torch.randn(3, 4, dtype=F64), torch.randn(2, 4, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"recv_counts\): \[1, 2\] differs"):
        epmoe.alltoallv_gmm(x, w, [2, 1], [1, 2])
    with pytest.raises(ValueError, match="group"):
        epmoe.gmm_alltoallv(x, w, [2, 1], [2, 1], group=object())
    with pytest.raises(TypeError, match="x"):
        epmoe.alltoallv_gmm(x.numpy(), w, [2, 1], [2, 1])
    with pytest.raises(TypeError, match="send_counts.*Python lists"):  # a device tensor would sync the host
        epmoe.alltoallv_gmm(x, w, torch.tensor([2, 1], device="meta"), [2, 1])
    y, shared_y, permuted = epmoe.alltoallv_gmm(x, w, torch.tensor([2, 1]), (2, 1))  # CPU tensor, tuple
    assert y.shape == (3, 3) and shared_y is None and permuted is None


def test_round_bounds_depend_only_on_e_and_chunks():
    assert round_bounds(5, 1) == [(0, 5)]
    assert round_bounds(5, 2) == [(0, 2), (2, 5)]
    assert round_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    plan = RowLayout(2, 2, (1, 2, 1, 0), (1, 2, 0, 1), ((0, 2),))
    assert plan.rows_per_expert_e == [1, 3]
    assert plan.rank_major_blocks(1, 2) == [(1, 2), (4, 0)]
    assert plan.to_expert_major(0, 2) == [(0, 1), (3, 0), (1, 2), (3, 1)]
    assert plan.to_source_major(0, 2) == [(0, 1), (1, 2), (1, 0), (3, 1)]


def _npu_plan(world, e, per_expert_rows, expert_major_rows=None):
    rank_major = (per_expert_rows,) * (world * e)
    expert_major = (expert_major_rows or per_expert_rows,) * (world * e)
    return RowLayout(world, e, rank_major, expert_major, ((0, e),))


def test_npu_fused_static_eligibility(monkeypatch):
    monkeypatch.setattr(fused_npu, "device_reason", lambda x: None)
    bf16 = torch.bfloat16
    x, w = torch.empty(0, 1024, dtype=bf16), torch.empty(2, 1024, 512, dtype=bf16)
    reason = fused_npu.static_reason
    assert reason(x, w, False, 8, 2) is None
    for world in (2, 4, 128):
        assert "EP size" in reason(x, w, False, world, 2)
    assert "local experts" in reason(x, torch.empty(33, 1024, 1, dtype=bf16), False, 8, 33)
    assert "global experts" in reason(x, torch.empty(32, 1024, 1, dtype=bf16), False, 16, 32)
    assert reason(x, torch.empty(16, 1024, 1, dtype=bf16), False, 16, 16) is None
    assert "dtype" in reason(x.float(), w.float(), False, 8, 2)
    assert reason(x.half(), w.half(), False, 8, 2) is None
    assert "input width" in reason(torch.empty(0, 65536, dtype=bf16), torch.empty(1, 65536, 1, dtype=bf16), False, 8, 1)
    assert "output width" in reason(x, torch.empty(1, 1024, 65536, dtype=bf16), False, 8, 1)
    assert "output width" in reason(x, torch.empty(1, 65536, 1024, dtype=bf16), True, 8, 1)


def test_npu_fused_volume_eligibility():
    two_mib_rows = 2 * 2**20 // (1024 * 2)  # rows per peer at width 1024 in bf16
    volume = fused_npu.volume_reason
    assert volume(_npu_plan(8, 2, two_mib_rows // 2), 1024, 2) is None
    assert "rank-major volume" in volume(_npu_plan(8, 2, two_mib_rows // 2 - 1), 1024, 2)
    assert "expert-major volume" in volume(_npu_plan(8, 2, two_mib_rows // 2, two_mib_rows // 2 - 1), 1024, 2)
    assert volume(_npu_plan(8, 2, 50 * two_mib_rows // 2), 1024, 2) is None  # exactly 100 MiB
    assert "rank-major volume" in volume(_npu_plan(8, 2, 50 * two_mib_rows // 2 + 1), 1024, 2)
    assert "rank-major volume" in volume(_npu_plan(8, 2, two_mib_rows // 2), 512, 2)  # the width counts
    one_peer_short = list(_npu_plan(8, 2, two_mib_rows // 2).counts_rank_major_WE)
    one_peer_short[5] -= 1  # rank 2's second expert
    plan = RowLayout(8, 2, tuple(one_peer_short), (two_mib_rows // 2,) * 16, ((0, 2),))
    assert "rank 2" in volume(plan, 1024, 2)
    assert "rows" in volume(_npu_plan(8, 2, 0), 1024, 2)


def test_npu_fused_device_checks(monkeypatch):
    x = torch.empty(1, 8)
    monkeypatch.setattr(platform, "torch_npu", lambda: None)
    assert "torch_npu is not installed" in fused_npu.device_reason(x)
    monkeypatch.setattr(platform, "torch_npu", lambda: object())
    assert "not an NPU" in fused_npu.device_reason(x)
    monkeypatch.setattr(platform, "device_type", lambda obj=None: "npu")
    for name, ok in (("Ascend910B3", False), ("Ascend910_9391", True), ("Ascend910_9581", False)):
        fake = type("FakeNpu", (), {"get_device_name": staticmethod(lambda index=None, n=name: n)})
        monkeypatch.setattr(platform, "device_module", lambda kind, fake=fake: fake)
        assert (fused_npu.device_reason(x) is None) == ok, name


def test_npu_fused_shared_expert_off_by_default(monkeypatch):
    sx, sw = torch.empty(4, 16), torch.empty(16, 8)
    monkeypatch.delenv(fused_npu.ENV_FUSE_SHARED, raising=False)
    assert "off by default" in fused_npu.fuse_shared_reason(sx, sw, False, 16)
    monkeypatch.setenv(fused_npu.ENV_FUSE_SHARED, "1")
    assert fused_npu.fuse_shared_reason(sx, sw, False, 16) is None
    assert "top-k" in fused_npu.fuse_shared_reason(sx, sw, False, 40)
    assert "hidden" in fused_npu.fuse_shared_reason(torch.empty(4, 12289), torch.empty(12289, 8), False, 16)


def test_hcom_name_uses_the_global_rank(monkeypatch):
    asked = []

    class Backend:
        def get_hccl_comm_name(self, rank):
            asked.append(rank)
            return f"hcom-{rank}"

    class Group:
        def _get_backend(self, device):
            return Backend()

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5 if group is None else 1)
    monkeypatch.setattr(torch, "device", lambda kind: kind)
    assert fused_npu.hcom_name(Group()) == "hcom-5" and asked == [5]


@pytest.mark.multirank
def test_bench_fused_quick(tmp_path, capsys):
    """``epmoe bench fused --quick``: every variant of every (shared, pass) setting, and the report."""
    from epmoe.bench import fused as bench_fused
    from epmoe.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "fused.md"
    try:
        assert main(["bench", "fused", "--quick", "--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(bench_fused.HEADERS)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    variants = ["compute only", "comm only", "unfused", "fused c=1", "fused c=2", "fused c=4"]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (shared, pass_, v) for shared in ("no", "yes") for pass_ in ("fwd", "fwd+bwd") for v in variants
    ]
    assert all(r[6] == "1.00" for r in rows if r[2] == "unfused")
    document = out.read_text()
    assert "epmoe bench fused --quick" in document and "--dist-backend gloo" in document and "## `tiny`" in document
    assert "--dist-backend nccl" in document  # the prepared command for GPUs
