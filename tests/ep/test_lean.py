"""The lean data path: routing indices (epmoe.ep.routing), the routed MLP op (epmoe.ep.mlp), what a
layer keeps for backward and how often it reads the host."""

import os

import pytest
import torch
from custom_moe import ExpertMLP
from host_reads import counting_host_reads
from torch import nn

from epmoe.bench.blocks import EPMOE, GROUPED, Shape, build_blocks
from epmoe.bench.lean import saved_elements_per_token
from epmoe.ep import recognize
from epmoe.ep.experts import LocalExperts
from epmoe.ep.mlp import routed_mlp_autograd, weighted_sum
from epmoe.ep.routing import GatherRows, SumRows, keep_first, pair_rows, token_rows
from epmoe.gmm import ENV_BACKEND
from epmoe.models import build_model


def random_routing(T, K, E, generator):
    """``(T, K)`` distinct experts per token."""
    return (
        torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
        if T
        else torch.zeros(0, K, dtype=torch.long)
    )


@pytest.mark.parametrize("T, K, E, W", [(9, 2, 8, 2), (13, 4, 8, 4), (6, 1, 4, 2), (0, 2, 8, 2), (7, 3, 6, 3)])
def test_token_rows_once_per_rank_in_rank_then_token_order(T, K, E, W):
    g = torch.Generator().manual_seed(T * 31 + K)
    index = random_routing(T, K, E, g)
    e = E // W
    expected = [(r, t) for r in range(W) for t in range(T) if any(int(x) // e == r for x in index[t])]
    rows = token_rows(index, e, W, len(expected))
    assert rows.token_R.tolist() == [t for _, t in expected]
    R = len(expected)
    for t in range(T):
        mine = [i for i, (_, tt) in enumerate(expected) if tt == t]
        assert rows.row_TD[t].tolist() == mine + [R] * (rows.row_TD.shape[1] - len(mine))
    x = torch.randn(T, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: GatherRows.apply(x, None, *rows), (x,))
    y = torch.randn(R, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda y: SumRows.apply(y, *rows), (y,))
    if T:
        want = torch.stack([y[[i for i, (_, tt) in enumerate(expected) if tt == t]].sum(0) for t in range(T)])
        torch.testing.assert_close(SumRows.apply(y, *rows), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("R, K, e, local", [(10, 2, 4, 0.6), (7, 4, 2, 0.3), (5, 3, 3, 1.0), (4, 2, 4, 0.0)])
def test_pair_rows_expert_major_stable(R, K, e, local):
    g = torch.Generator().manual_seed(R * K)
    local_expert = torch.randint(0, e, (R, K), generator=g)
    local_expert[torch.rand(R, K, generator=g) >= local] = e  # another rank's expert
    valid = [(int(local_expert[r, k]), r, k) for r in range(R) for k in range(K) if local_expert[r, k] < e]
    pairs = pair_rows(local_expert, e, len(valid))
    assert pairs.slot_P.tolist() == [r * K + k for _, r, k in sorted(valid)]
    assert pairs.counts_e.tolist() == [sum(1 for j, _, _ in valid if j == x) for x in range(e)]
    P = len(valid)
    for p, s in enumerate(pairs.slot_P.tolist()):
        assert pairs.pair_RK.view(-1)[s] == p
    assert int((pairs.pair_RK == P).sum()) == R * K - P


def test_keep_first_keeps_each_experts_first_pairs():
    g = torch.Generator().manual_seed(3)
    R, K, e, capacity = 12, 2, 3, 4
    local_expert = torch.randint(0, e + 1, (R, K), generator=g)
    counts = [int((local_expert == j).sum()) for j in range(e)]
    pairs = pair_rows(local_expert, e, sum(counts), counts)
    kept, dropped = keep_first(pairs, capacity, counts)
    assert dropped == [max(0, n - capacity) for n in counts]
    want = [s for j in range(e) for s in pairs.slot_P.tolist() if local_expert.view(-1)[s] == j][:0]
    for j in range(e):
        want += [s for s in pairs.slot_P.tolist() if local_expert.view(-1)[s] == j][:capacity]
    assert kept.slot_P.tolist() == want
    assert kept.host_counts_e == [min(n, capacity) for n in counts] == kept.counts_e.tolist()
    P = len(want)
    assert sorted(kept.pair_RK[kept.pair_RK < P].tolist()) == list(range(P))


def _experts(kind):
    if kind == "module_list":
        return nn.ModuleList(ExpertMLP(16, 8) for _ in range(4)).double()
    model = build_model(kind, num_experts=4, dtype=torch.float64)
    return next(m for m in model.modules() if recognize.is_packed_experts(m))


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "module_list"])
@pytest.mark.parametrize("routing", ["partial", "all_on_one", "none_local"])
def test_routed_mlp_equals_plain_autograd(kind, routing):
    """epmoe::routed_mlp (recompute in backward) against the same computation through plain
    autograd: output and every gradient (rows, routing weights, weights, biases), fp64."""
    module = _experts(kind)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.2)
    experts = LocalExperts(module)
    assert experts.lean
    H = 16 if kind == "module_list" else module.down_proj.shape[2 if module.is_transposed else 1]
    R, K, e = 9, 3, 4
    local = torch.randint(0, e + 1, (R, K), generator=g)
    if routing == "all_on_one":
        local[:, 0] = 2
    if routing == "none_local":
        local[:] = e
    counts = [int((local == j).sum()) for j in range(e)]
    pairs = pair_rows(local, e, sum(counts), counts)
    x = torch.randn(R, H, generator=g, dtype=torch.float64)
    w = torch.rand(R, K, generator=g, dtype=torch.float64)
    dy = torch.randn(R, H, generator=g, dtype=torch.float64)

    def run(fn):
        module.zero_grad(set_to_none=True)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws)
        out.backward(dy)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]
        return [out, xs.grad, ws.grad, *grads]

    lean = run(lambda xs, ws: experts.routed_mlp(xs, ws, pairs))
    plain = run(lambda xs, ws: routed_mlp_autograd(lambda x_PH, c: experts.forward(x_PH, c), xs, ws, pairs))
    for got, want in zip(lean, plain):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    again = run(lambda xs, ws: experts.routed_mlp(xs, ws, pairs))
    assert all(torch.equal(a, b) for a, b in zip(lean, again))  # bitwise, run to run


@pytest.mark.parametrize("padded", [False, True])
def test_routed_mlp_opcheck(padded):
    """The op's schema, fake kernel and autograd; ``padded``: the static transport's pairs (every
    (row, k), some of them another rank's expert: padding past the counts)."""
    module = _experts("gpt_oss").float()
    experts = LocalExperts(module)
    R, K, e = 6, 2, 4
    local = torch.randint(0, e + padded, (R, K), generator=torch.Generator().manual_seed(0))
    pairs = pair_rows(local, e, padded=padded)
    H = module.down_proj.shape[2 if module.is_transposed else 1]
    args = (
        torch.randn(R, H, requires_grad=True),
        torch.rand(R, K, requires_grad=True),
        pairs.slot_P,
        pairs.pair_RK,
        pairs.counts_e,
        None,
        module.gate_up_proj,
        module.down_proj,
        module.gate_up_proj_bias,
        module.down_proj_bias,
        not module.is_transposed,
        experts.key,
        True,
        padded,
    )
    torch.library.opcheck(torch.ops.epmoe.routed_mlp.default, args)


def test_weighted_sum_skips_rows_without_pairs_even_next_to_nan():
    y = torch.tensor([[1.0], [float("nan")]])
    pair = torch.tensor([[0, 2], [2, 2]])  # row 1 has no pair; row 0 one
    out = weighted_sum(y, torch.ones(2, 2), pair, torch.float32)
    assert out.tolist() == [[1.0], [0.0]]


SHAPE = Shape("Qwen3-30B-A3B-like", num_experts=32, top_k=8, hidden=256, intermediate=96, tokens=128)


def test_saved_per_token_at_ep1_is_sonicmoe_bound():
    """H + 2KI + E (SonicMoE's bound plus the router's probabilities), plus the routing indices and
    weights (a few K per token); transformers' grouped_mm experts keep K(2H + 4I) more."""
    blocks = build_blocks(SHAPE, 0, torch.device("cpu"))
    x = torch.randn(1, SHAPE.tokens, SHAPE.hidden)
    dy = torch.randn_like(x)
    H, I, K, E = SHAPE.hidden, SHAPE.intermediate, SHAPE.top_k, SHAPE.num_experts
    lean = saved_elements_per_token(blocks[EPMOE], x, dy)
    plain = saved_elements_per_token(blocks[GROUPED], x, dy)
    assert H + 2 * K * I <= lean <= H + 2 * K * I + E + 10 * K, lean
    assert plain >= K * (2 * H + 4 * I), plain  # the measurement sees per-slot tensors


def test_no_host_read_at_ep1(monkeypatch):
    """A forward + backward of an EP-1 block reads nothing to the host on a backend that takes its
    counts on the device (torch); the loop backend needs them, read once per op (the control: reads
    are seen)."""
    blocks = build_blocks(
        Shape("small", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=16), 0, torch.device("cpu")
    )
    x = torch.randn(1, 16, 64, requires_grad=True)

    def reads():
        with counting_host_reads() as calls:
            blocks[EPMOE](x).sum().backward()
        return calls

    assert reads() == []
    monkeypatch.setitem(os.environ, ENV_BACKEND, "loop")
    assert reads() == ["tolist", "tolist"]  # a host-counts backend: once in forward, once in backward


def test_a_deep_copy_runs_its_own_gate_after_the_original_is_gone():
    import copy
    import gc

    blocks = build_blocks(
        Shape("small", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=16), 0, torch.device("cpu")
    )
    original = blocks.pop(EPMOE)
    twin = copy.deepcopy(original)
    x = torch.randn(1, 16, 64)
    want = original(x)
    del original
    gc.collect()
    y = twin(x.requires_grad_())
    y.sum().backward()
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("bad", [8, -1])
def test_out_of_range_expert_raises_at_ep1(bad):
    """On one rank a choice outside [0, E) raises, never counts as another rank's (a zero output)."""
    blocks = build_blocks(
        Shape("small", num_experts=8, top_k=2, hidden=64, intermediate=32, tokens=4), 0, torch.device("cpu")
    )
    experts = blocks[EPMOE].experts
    index = torch.tensor([[0, 1], [2, bad], [3, 4], [5, 6]])
    with pytest.raises(RuntimeError):
        experts(torch.randn(4, 64), index, torch.rand(4, 2))
