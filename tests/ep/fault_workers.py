"""Rank functions for tests/ep/test_faults.py: faults injected into real gloo ranks.

Cases that leave the process group healthy (an agreement that fails, ranks out of step) share one
spawned run each; a rank that dies needs a run of its own. Workers return plain data: the error
each rank saw and when.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from custom_moe import TinyMoELM
from ep_layer_workers import base_model, experts_of, max_rel, run_module

import epmoe
from epmoe.models import build_model


def _outcome(fn) -> dict:
    """Run ``fn``; return what it raised (type, message, seconds it took) or that it returned."""
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type and message
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    return {"type": None, "message": "", "seconds": time.monotonic() - started}


# --------------------------------------------------------------------------------------------
# fused ops with arguments the peers do not match: ValueError on every rank, no abort
# --------------------------------------------------------------------------------------------


def _fused_args(rank: int, world: int, e: int = 2, H: int = 8, N: int = 6, dtype=torch.float64, seed: int = 0):
    """Valid arguments of ``alltoallv_gmm`` on this rank: counts ``send[r*e + j] = 1 + (rank + r + j) % 3``."""
    g = torch.Generator().manual_seed(seed + rank)
    send = [1 + (rank + r + j) % 3 for r in range(world) for j in range(e)]
    recv = [1 + (s + rank + j) % 3 for s in range(world) for j in range(e)]
    x = torch.randn(sum(send), H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(e, H, N, generator=g, dtype=torch.float64).to(dtype)
    return x, weight, send, recv


def agreement_run(rank: int, world: int) -> dict:
    from epmoe.comm.fused import alltoallv_gmm, gmm_alltoallv

    out = {}

    def dispatch(impl="pipelined", **change):
        def run():
            x, weight, send, recv = _fused_args(rank, world)
            args = dict(x=x, weight=weight, send_counts=send, recv_counts=recv, num_chunks=1)
            if rank == 1:
                args.update(change)
            alltoallv_gmm(
                args.pop("x"), args.pop("weight"), args.pop("send_counts"), args.pop("recv_counts"), impl=impl, **args
            )

        return run

    def swapped(counts):  # the same rows per source, split differently over the local experts
        return [counts[1], counts[0]] + counts[2:]

    for impl in ("pipelined", "reference"):
        x, weight, send, recv = _fused_args(1, world)
        out[f"recv_counts_permuted/{impl}"] = _outcome(dispatch(impl, recv_counts=swapped(recv)))
        moved = list(recv)
        moved[0] += 1
        moved[2] -= 1  # rank 1 expects one row more from rank 0 and one fewer from itself
        out[f"recv_counts_moved/{impl}"] = _outcome(dispatch(impl, recv_counts=moved))
    out["num_chunks"] = _outcome(dispatch(num_chunks=2))
    x, weight, _, _ = _fused_args(1, world, dtype=torch.float32)
    out["dtype"] = _outcome(dispatch(x=x, weight=weight))
    x, weight, _, _ = _fused_args(1, world, H=12)
    out["width"] = _outcome(dispatch(x=x, weight=weight))
    _, _, _, recv = _fused_args(1, world)
    out["recv_counts_too_long"] = _outcome(dispatch(recv_counts=recv + [0]))
    out["recv_counts_too_short"] = _outcome(dispatch(recv_counts=recv[:-1]))

    def combine_permuted():
        x, weight, send, recv = _fused_args(rank, world)
        y = torch.randn(sum(recv), 6, dtype=torch.float64)
        down = torch.randn(2, 6, 8, dtype=torch.float64)
        gmm_alltoallv(y, down, swapped(recv) if rank == 1 else recv, send)

    out["gmm_alltoallv_send_counts_permuted"] = _outcome(combine_permuted)

    def lengths():
        epmoe.exchange_counts(torch.ones(4 if rank == 0 else 6, dtype=torch.int64))

    out["exchange_counts_lengths"] = _outcome(lengths)

    def invalid_on_one_rank():  # rank 1's length is not a multiple of the group size
        epmoe.exchange_counts(torch.ones(4 if rank == 0 else 5, dtype=torch.int64))

    out["exchange_counts_invalid_on_one_rank"] = _outcome(invalid_on_one_rank)

    def negative():
        counts = torch.ones(20_000, dtype=torch.int64)
        if rank == 1:
            counts[[5, 17]] = -1
        epmoe.exchange_counts(counts)

    out["exchange_counts_negative"] = _outcome(negative)

    def healthy():  # after all of the above the group still works and gives the right rows
        x, weight, send, recv = _fused_args(rank, world)
        y, _, _ = alltoallv_gmm(x, weight, send, recv, impl="pipelined")
        y_ref, _, _ = alltoallv_gmm(x, weight, send, recv, impl="reference")
        assert torch.equal(y, y_ref)

    out["healthy_after"] = _outcome(healthy)
    return out


# --------------------------------------------------------------------------------------------
# ranks out of step: OutOfStepError on every rank; a rank that raises and stays alive
# --------------------------------------------------------------------------------------------


def _tiny(rank: int, timeout: float | None = None):
    torch.manual_seed(0)
    model = TinyMoELM().double()
    epmoe.apply_expert_parallel(model, config={"timeout": timeout, "check_steps": True})
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(rank))
    return model, ids


def out_of_step_run(rank: int, world: int, timeout: float) -> dict:
    out = {}

    def skip_backward():
        model, ids = _tiny(rank)
        loss = model(ids).sum()
        if rank == 0:
            loss.backward()
        model(ids)

    def skip_layer():
        model, ids = _tiny(rank)
        h = model.embed(ids)
        for block in model.blocks[rank:]:  # rank 1 skips the first MoE block
            h = h + block(h)[0]

    def skip_step():  # rank 1 has no batch at step 1 and skips forward and backward, not clipping
        model, ids = _tiny(rank)
        for step in range(3):
            if not (rank == 1 and step == 1):
                model(ids).sum().backward()
            epmoe.clip_grad_norm_(model, 1.0)

    def in_step():  # the same three steps, every rank: nothing raised
        model, ids = _tiny(rank)
        for _ in range(3):
            model(ids).sum().backward()
            epmoe.clip_grad_norm_(model, 1.0)

    for name, fn in (
        ("skip_backward", skip_backward),
        ("skip_layer", skip_layer),
        ("skip_step", skip_step),
        ("in_step", in_step),
    ):
        out[name] = _outcome(fn)
        dist.barrier()

    def raise_and_stay_alive():
        model, ids = _tiny(rank, timeout=timeout)
        if rank == 1:
            try:
                raise RuntimeError("injected: a data-loading error on rank 1, caught and logged")
            except RuntimeError:
                time.sleep(timeout + 5)  # alive, in no collective
            return
        model(ids).sum().backward()

    out["raise_and_stay_alive"] = _outcome(raise_and_stay_alive)
    return out


# --------------------------------------------------------------------------------------------
# a rank that dies: each case its own run; the survivors record what they saw and when
# --------------------------------------------------------------------------------------------


def _die(where: str, tmp: str) -> None:
    Path(tmp, "died.json").write_text(json.dumps({"where": where, "time": time.time()}))
    if where == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def dying_run(rank: int, world: int, where: str, tmp: str) -> None:
    config = {"timeout": 20.0}
    if where == "fused":
        config.update(dispatch="fused", num_chunks=2)
    model = build_model("qwen3_moe", num_experts=4)
    epmoe.apply_expert_parallel(model, config=config)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(rank))
    last = model.model.layers[-1].mlp
    if rank == 1:
        if where in ("forward", "exit"):
            last.experts.register_forward_pre_hook(lambda *_: _die(where, tmp))
        elif where == "backward":

            def die_in_backward(_module, _inputs, out):
                out.register_hook(lambda _grad: _die(where, tmp))

            last.register_forward_hook(die_in_backward)
        elif where == "fused":  # inside the pipeline: after the first round's grouped matmul
            import epmoe.comm.fused.pipelined as pipelined

            gmm = pipelined.run_grouped_mm

            def gmm_then_die(*args, **kwargs):  # round 0 computed, round 1 still to exchange
                gmm(*args, **kwargs)
                _die(where, tmp)

            pipelined.run_grouped_mm = gmm_then_die
    started = time.time()
    try:
        for _ in range(2):
            model(ids).logits.sum().backward()
    except Exception as exc:
        Path(tmp, f"rank{rank}.json").write_text(
            json.dumps({"type": type(exc).__name__, "message": str(exc), "time": time.time(), "started": started})
        )
        raise


# --------------------------------------------------------------------------------------------
# random routings (hypothesis): fp64 parity with the unsharded experts module
# --------------------------------------------------------------------------------------------


def random_routings_run(rank: int, world: int, num_experts: int, examples: int) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    K = 2
    base = (
        base_model("qwen3_moe")
        if num_experts == 8
        else build_model("qwen3_moe", num_experts=num_experts, dtype=torch.float64)
    )
    variants = {}
    for dispatch in ("alltoallv", "fused"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config={"dispatch": dispatch})
        variants[dispatch] = experts_of(model)
    reference = experts_of(base)
    H = reference.gate_up_proj.shape[-1]
    seen = {"examples": 0, "worst": 0.0, "empty_ranks": 0, "one_expert": 0, "duplicates": 0}

    one_rank = st.integers(0, 5).flatmap(
        lambda T: st.lists(st.lists(st.integers(0, num_experts - 1), min_size=K, max_size=K), min_size=T, max_size=T)
    )
    routing = st.one_of(
        st.lists(one_rank, min_size=world, max_size=world),
        st.tuples(st.integers(0, num_experts - 1), st.lists(st.integers(0, 5), min_size=world, max_size=world)).map(
            lambda a: [[[a[0]] * K] * T for T in a[1]]
        ),  # every slot on one expert
    )

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(routing=routing, seed=st.integers(0, 2**16))
    def check(routing, seed):
        g = torch.Generator().manual_seed(seed)
        inputs = []
        for src in range(world):
            T = len(routing[src])
            index = torch.tensor(routing[src], dtype=torch.int64).view(T, K)
            inputs.append(
                (
                    torch.randn(T, H, generator=g, dtype=torch.float64),
                    index,
                    torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), -1),
                    torch.randn(T, H, generator=g, dtype=torch.float64),
                )
            )
        ref = copy.deepcopy(reference)
        cat = [torch.cat(parts) for parts in zip(*inputs)]
        ref_out, ref_dh, ref_dw = run_module(ref, *cat, dtype=torch.float64)
        start = sum(len(inputs[r][0]) for r in range(rank))
        rows = slice(start, start + len(inputs[rank][0]))
        for ep in variants.values():
            ep.zero_grad(set_to_none=True)
            mine = [t.clone() for t in inputs[rank]]  # fresh leaves: .grad must not accumulate over variants
            out, dh, dw = run_module(ep, *mine, dtype=torch.float64, needs_graph=True)
            shard = ep._epmoe.shard
            errors = [max_rel(out, ref_out[rows]), max_rel(dh, ref_dh[rows]), max_rel(dw, ref_dw[rows])]
            for name, param in ep.named_parameters():
                full = dict(ref.named_parameters())[name].grad
                want = torch.zeros_like(param) if full is None else full[shard.local_start : shard.local_end]
                errors.append(max_rel(param.grad, want))
            seen["worst"] = max(seen["worst"], *errors)
            assert max(errors) < 1e-10, (routing, errors)
        seen["examples"] += 1
        seen["empty_ranks"] += any(len(r) == 0 for r in routing)
        flat = [e for r in routing for token in r for e in token]
        seen["one_expert"] += bool(flat) and len(set(flat)) == 1
        seen["duplicates"] += any(len(set(token)) < K for r in routing for token in r)

    check()
    return seen
