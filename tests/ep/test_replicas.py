"""Expert replicas (``ExpertParallelConfig(replicas=N)``): the plan, its row maps, the config, and
(multirank) exactness against the same EP model without replicas and the unsharded model."""

import itertools
import math
import random

import pytest
import torch

import epmoe
from epmoe.ep.replicas import Move, ReplicaPlan, min_rows, plan_replicas
from epmoe.ep.routing import RouteIds, redirected_slots, replica_rows, token_rows
from epmoe.models import build_model


def zipf_matrix(rng: random.Random, W: int, e: int, tokens: int, K: int, skew: float) -> list[list[int]]:
    """Slots rank s sends expert g: ``tokens`` tokens per rank, K distinct experts each, expert g
    drawn with weight 1/(g+1)^skew after a random relabelling."""
    E = W * e
    label = list(range(E))
    rng.shuffle(label)
    weights = [1 / (label[g] + 1) ** skew for g in range(E)]
    slots_WE = []
    for _ in range(W):
        row = [0] * E
        for _ in range(tokens):
            for g in set(rng.choices(range(E), weights, k=K)):
                row[g] += 1
        slots_WE.append(row)
    return slots_WE


def routed_W(slots_WE, e):
    W = len(slots_WE)
    return [sum(sum(row[r * e : (r + 1) * e]) for row in slots_WE) for r in range(W)]


def test_plan_brings_the_most_loaded_rank_to_the_mean_with_the_same_total():
    rng = random.Random(0)
    for _ in range(300):
        W, e = rng.choice([2, 4, 8]), rng.choice([1, 2, 4])
        slots_WE = zipf_matrix(rng, W, e, rng.randint(0, 60), min(2, W * e), rng.choice([0.0, 1.0, 2.0]))
        plan = plan_replicas(slots_WE, e, replicas=e + W, least=0)
        before, after = routed_W(slots_WE, e), plan.computed_rows_W()
        assert sum(after) == sum(before)
        assert max(after) <= max(math.ceil(sum(before) / W), 0), (slots_WE, plan.moves)
        assert plan == plan_replicas([list(r) for r in slots_WE], e, e + W, 0)  # a function of its inputs


def test_each_experts_slots_are_split_into_consecutive_ranges():
    rng = random.Random(1)
    for _ in range(200):
        W, e = rng.choice([2, 4]), rng.choice([1, 2, 4])
        slots_WE = zipf_matrix(rng, W, e, 40, 2, 2.0)
        plan = plan_replicas(slots_WE, e, replicas=rng.choice([1, 2, 3]), least=0)
        for g in range(W * e):
            load = sum(row[g] for row in slots_WE)
            moves = sorted((m for m in plan.moves if m.expert == g), key=lambda m: m.start)
            kept = plan.local_counts(g // e)[g % e]
            assert [kept] + [m.stop for m in moves[:-1]] == [m.start for m in moves] or not moves
            assert kept + sum(m.slots for m in moves) == load
            for m in moves:  # what the sources redirect adds up to the move
                assert sum(hi - lo for lo, hi in (plan.redirected(s, m) for s in range(W))) == m.slots
                assert m.helper != m.owner
        for h in range(W):
            assert len(plan.received(h)) <= plan_replicas(slots_WE, e, 3, 0).ep_size * e
            assert len({m.expert for m in plan.received(h)}) == len(plan.received(h))


def test_a_rank_lends_or_helps_at_most_replicas_experts():
    rng = random.Random(2)
    for replicas in (1, 2):
        for _ in range(100):
            slots_WE = zipf_matrix(rng, 4, 4, 50, 2, 2.0)
            plan = plan_replicas(slots_WE, 4, replicas, 0)
            assert all(len(plan.received(h)) <= replicas for h in range(4))


def test_replicas_zero_or_balanced_routing_plans_nothing():
    assert plan_replicas([[5, 5], [5, 5]], 1, replicas=0, least=0).moves == ()
    assert plan_replicas([[3, 3, 3, 3], [3, 3, 3, 3]], 2, replicas=2, least=0).moves == ()
    assert plan_replicas([[0, 0], [0, 0]], 1, replicas=2, least=0).moves == ()


def test_the_worked_example_of_the_docs():
    """1505 and 543 slots on two ranks of 4 experts: 481 of the hottest expert's slots move."""
    slots_WE = [[450, 105, 100, 100, 75, 65, 65, 67], [450, 100, 100, 100, 75, 65, 65, 66]]
    plan = plan_replicas(slots_WE, 4, replicas=1, least=0)
    assert routed_W(slots_WE, 4) == [1505, 543]
    assert plan.moves == (Move(0, 0, 1, 419, 900),)
    assert plan.computed_rows_W() == [1024, 1024] and plan.moved_W() == [-481, 481]
    assert plan.local_counts(1) == [150, 130, 130, 133, 481] and plan.replica_index(plan.moves[0]) == 4


def test_the_cost_model():
    # training: m > 2 F b rho / (6 F - 4 H b rho)
    assert min_rows(1000, 10, 4, 5.0, backward=True) == pytest.approx(2 * 1000 * 4 * 5 / (6000 - 4 * 10 * 4 * 5))
    assert min_rows(1000, 10, 4, 5.0, backward=False) == pytest.approx(1000 * 4 * 5 / (2000 - 2 * 10 * 4 * 5))
    assert min_rows(1000, 100, 4, 50.0, backward=True) == math.inf  # a row costs more to send than to compute
    assert min_rows(1000, 10, 4, 0.0, backward=True) == 0.0  # a free link: any imbalance
    # the benchmark's shape (H 512, I 1024, fp32) at this CPU's loopback rate (~35 flops per byte): a few dozen slots
    F = 3 * 512 * 1024
    least = min_rows(F, 512, 4, 35.0, backward=True)
    assert 10 < least < 200
    assert plan_replicas([[900, 205, 200, 200, 150, 130, 130, 133], [0] * 8], 4, 1, least).moves
    assert plan_replicas([[300 + least // 4, 205, 200, 200, 250, 230, 230, 233], [0] * 8], 4, 1, least).moves == ()


def test_a_helper_on_the_owners_node_is_taken_at_equal_load():
    """Ranks 0, 1 on node 0, ranks 2, 3 on node 1 (e = 2): rank 2 is hot, ranks 0, 1, 3 equally idle.
    Without nodes the lowest rank helps; with them rank 3, on the owner's node."""
    slots_WE = [[60, 40, 70, 30, 300, 100, 50, 50]] + [[0] * 8] * 3  # rank 0 sends them all
    assert plan_replicas(slots_WE, 2, 1, 0).moves[0][:3] == (4, 2, 0)
    plan = plan_replicas(slots_WE, 2, 1, 0, between=0, nodes_W=[0, 0, 1, 1])
    assert plan.moves[0][:3] == (4, 2, 3)
    assert sum(m.slots for m in plan.moves) == sum(m.slots for m in plan_replicas(slots_WE, 2, 1, 0).moves)


def test_each_move_is_priced_by_the_link_it_crosses():
    """A move that pays inside a node (10 slots) but not between nodes (1000): the least loaded helper,
    on the other node, is passed over for one on the owner's node; with no helper left on the owner's
    node the plan stops. At one price for every link the least loaded helper takes it."""
    slots_WE = [[25, 25, 100, 50, 300, 100, 50, 50]] + [[0] * 8] * 3  # loads [50, 150, 400, 100], target 175
    plan = plan_replicas(slots_WE, 2, 2, 10, between=1000, nodes_W=[0, 0, 1, 1])
    assert [m[:3] for m in plan.moves] == [(4, 2, 3)] and plan.moves[0].slots == 75
    cheap = plan_replicas(slots_WE, 2, 2, 10, between=10, nodes_W=[0, 0, 1, 1])
    assert cheap.moves[0][:3] == (4, 2, 0) and cheap.moves[0].slots == 125
    assert plan_replicas(slots_WE, 2, 2, 10, between=1000, nodes_W=[0, 1, 2, 3]).moves == ()


def test_sources_find_their_redirected_slots_and_rows():
    """The device-side row maps against a loop over the slots."""
    g = torch.Generator().manual_seed(3)
    W, e, K, T = 2, 3, 2, 9
    index = torch.stack([torch.randperm(W * e, generator=g)[:K] for _ in range(T)])
    counts = torch.bincount(index.reshape(-1), minlength=W * e).tolist()
    other = [5, 1, 0, 2, 3, 7]
    plan = ReplicaPlan(
        (Move(index[0, 0].item(), index[0, 0].item() // e, 1 - index[0, 0].item() // e, 0, 0),), (counts, other), e
    )
    g0 = index[0, 0].item()
    # the second half of expert g0's slots of this rank (source 0) move
    half = counts[g0] // 2
    move = Move(g0, g0 // e, 1 - g0 // e, half, counts[g0] + other[g0])
    plan = ReplicaPlan((move,), (tuple(counts), tuple(other)), e)
    lo, hi = plan.redirected(0, move)
    assert (lo, hi) == (half, counts[g0])
    assert plan.moves_from(0) == [[g0, lo, hi, move.helper, 0]]  # the helper's lent expert 0
    redirected = redirected_slots(index, plan.moves_from(0), W, hi - lo)
    moved_TK, slot_X, helper_X, lent_X = redirected
    mine = [t * K + k for t in range(T) for k in range(K) if index[t, k] == g0]
    assert slot_X.tolist() == mine[lo:hi] and helper_X.tolist() == [move.helper] * (hi - lo)
    assert lent_X.tolist() == [0] * (hi - lo)
    assert moved_TK.reshape(-1).nonzero().squeeze(1).tolist() == mine[lo:hi]
    send_rows_W = [sum(any(index[t, k] // e == r for k in range(K)) for t in range(T)) for r in range(W)]
    rows = token_rows(index, e, W, sum(send_rows_W))
    ids = RouteIds(e, W * e)
    rows, ids_RK = replica_rows(index, rows, send_rows_W, redirected, helper_X, ids)
    E, want_tokens, want_ids, want_rank = W * e, [], [], []
    for r in range(W):
        for t in range(T):
            if any(index[t, k] // e == r for k in range(K)):
                want_tokens.append(t)
                want_ids.append([index[t, k].item() + E * (t * K + k in mine[lo:hi]) for k in range(K)])
                want_rank.append([index[t, k].item() // e for k in range(K)])
        for s in mine[lo:hi] if r == move.helper else []:
            want_tokens.append(s // K)
            want_ids.append([2 * E + r * E if k == s % K else -1 for k in range(K)])
            want_rank.append([r if k == s % K else -1 for k in range(K)])
    assert rows.token_R.tolist() == want_tokens
    assert ids_RK.tolist() == want_ids
    assert ids.rank_RK(ids_RK).tolist() == want_rank
    for r in range(W):  # each rank's own choices and lent ones, read off the ids
        own_RK, lent_RK = ids.local(ids_RK, r, 1)
        own = [[i - r * e if r * e <= i < (r + 1) * e else e for i in row] for row in want_ids]
        lent = [[0 if i == 2 * E + r * E else 1 for i in row] for row in want_ids]
        assert own_RK.tolist() == own and lent_RK.tolist() == lent
    for t in range(T):  # each token's rows, in row order
        mine_rows = [i for i, tok in enumerate(want_tokens) if tok == t]
        got = [i for i in rows.row_TD[t].tolist() if i < len(want_tokens)]
        assert got == mine_rows


def reference_plan(slots_WE, e, replicas, least):
    """The greedy of the module docstring written straightforwardly (every rank scanned each step):
    ``[(expert, owner, helper, start, stop)]`` in the order made."""
    W = len(slots_WE)
    load_E = [sum(column) for column in zip(*slots_WE)]
    keep_E = list(load_E)
    load_W = [sum(load_E[r * e : (r + 1) * e]) for r in range(W)]
    target = math.ceil(sum(load_W) / W)
    helped_W, helpers, moves = [0] * W, {g: set() for g in range(len(load_E))}, []
    while True:
        owner = max(range(W), key=lambda r: (load_W[r], -r))
        room = [h for h in range(W) if h != owner and load_W[h] < target and helped_W[h] < replicas]
        if load_W[owner] <= target or not room:
            return moves
        helper = min(room, key=lambda h: (load_W[h], h))
        candidates = [g for g in range(owner * e, (owner + 1) * e) if keep_E[g] > 0 and helper not in helpers[g]]
        if not candidates:
            return moves
        expert = max(candidates, key=lambda g: (keep_E[g], -g))
        slots = min(load_W[owner] - target, target - load_W[helper], keep_E[expert])
        if slots < least:
            return moves
        keep_E[expert] -= slots
        moves.append((expert, owner, helper, keep_E[expert], keep_E[expert] + slots))
        load_W[owner] -= slots
        load_W[helper] += slots
        helped_W[helper] += 1
        helpers[expert].add(helper)


def reference_rows_WW(slots_WE, moves):
    """``rows[s][h]``: the rows of their own source ``s`` sends helper ``h`` (its slots of each move's
    range in the global order, from every source's place in it)."""
    W = len(slots_WE)
    rows = [[0] * W for _ in range(W)]
    for g, _, h, start, stop in moves:
        before = 0
        for s in range(W):
            mine = slots_WE[s][g]
            rows[s][h] += max(0, min(stop, before + mine) - max(start, before))
            before += mine
    return rows


def random_matrices(rng, cases):
    """``(slots_WE, e, replicas, least)``: Zipf-skewed (and uniform) slot matrices up to 64 ranks."""
    for _ in range(cases):
        W, e = rng.choice([1, 2, 3, 4, 8, 16, 32, 64]), rng.choice([1, 2, 3])
        skew = rng.choice([0.0, 0.5, 1.0, 2.0])
        slots_WE = zipf_matrix(rng, W, e, rng.randint(0, 40), min(rng.choice([1, 2, 4]), W * e), skew)
        yield slots_WE, e, rng.choice([0, 1, 2, 3]), rng.choice([0, 0, 1, 4, 20])


def test_the_plan_makes_the_straightforward_greedys_moves_and_tables():
    """Ties, order and every query against the straightforward greedy and a loop over every source."""
    rng = random.Random(5)
    moved = 0
    for slots_WE, e, replicas, least in random_matrices(rng, 400):
        plan = plan_replicas(slots_WE, e, replicas, least)
        want = reference_plan(slots_WE, e, replicas, least)
        assert [tuple(m) for m in plan.moves] == want, (slots_WE, e, replicas, least)
        moved += len(want)
        W, rows_WW = len(slots_WE), reference_rows_WW(slots_WE, want)
        for r in range(W):
            assert plan.redirected_rows_W(r) == rows_WW[r]
            into_W = [0] * W
            for source, rows in plan.rows_into(r):
                into_W[source] += rows
            assert into_W == [rows_WW[s][r] for s in range(W)]
            assert sum(hi - lo for _, lo, hi, _, _ in plan.moves_from(r)) == sum(rows_WW[r])
            sent, received = plan.sent(r), plan.received(r)
            index, send_W, recv_W = plan.lending(r)
            assert index == [m.expert - r * e for m in sent]
            assert send_W == [sum(m.helper == h for m in sent) for h in range(W)]
            assert recv_W == [sum(m.owner == s for m in received) for s in range(W)]
            assert [plan.replica_index(m) for m in received] == list(range(e, e + len(received)))
    assert moved > 500


@pytest.mark.parametrize(
    "hidden_dtype, weights_dtype",
    [
        (torch.float64, torch.float32),  # the route in float64: K = 3 float32 ids would fill no whole column
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64),
    ],
    ids=str,
)
def test_replica_rows_arrive_exact_with_their_pairs(hidden_dtype, weights_dtype):
    """The per-rank exchange's rows under a plan, sent by every rank and read by every rank (the
    all-to-all-v by hand): each slot computed exactly once, by its expert's owner or its helper, on its
    token's hidden state and weight, bit for bit, with K odd."""
    from epmoe.comm.steps import Position
    from epmoe.ep.config import ExpertShard
    from epmoe.ep.counts import LayerCounts
    from epmoe.ep.dispatch import Link, alltoallv
    from epmoe.ep.dispatch.replica_rows import arrived_with_replicas, send_with_replicas

    W, e, K, T, H = 2, 2, 3, 10, 5
    E, g = W * e, torch.Generator().manual_seed(7)
    # experts 0 and 1 (rank 0) in every token: rank 0 is hot
    index_W = [
        torch.stack([torch.cat([torch.tensor([0, 1]), 2 + torch.randperm(2, generator=g)[:1]]) for _ in range(T)])
    ]
    index_W.append(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]))
    hidden_W = [torch.randn(T, H, generator=g).to(hidden_dtype) for _ in range(W)]
    weights_W = [torch.rand(T, K, generator=g).to(weights_dtype) for _ in range(W)]
    slots_WE = [torch.bincount(index.reshape(-1), minlength=E).tolist() for index in index_W]
    plan = plan_replicas(slots_WE, e, replicas=1, least=0)
    assert plan.moves
    rows_WW = [[int(((index // e) == r).any(1).sum()) for r in range(W)] for index in index_W]
    links, sent_W, tokens_W = [], [], []
    for s in range(W):
        counts = LayerCounts(
            send_counts_WE=[],
            recv_counts_WE=[],
            local_counts_e=[sum(row[j] for row in slots_WE) for j in range(s * e, (s + 1) * e)],
            group=None,
            global_slots=W * T * K,
            send_rows_W=rows_WW[s],
            recv_rows_W=[rows_WW[source][s] for source in range(W)],
            peer_guards=None,
            slots_WE=slots_WE,
        )
        shard = ExpertShard("experts", E, e, s * e, (s + 1) * e, s, W)
        links.append(Link(None, shard, Position(0, 0, 0), False, counts, plan=plan))
        send_W, _ = alltoallv._replica_splits(counts, plan, s)
        sent_RX, rows = send_with_replicas(
            hidden_W[s], index_W[s], weights_W[s], links[s], rows_WW[s], 1, sum(send_W) - sum(rows_WW[s])
        )
        sent_W.append(sent_RX.split(send_W))
        tokens_W.append(rows.token_R.split(send_W))
    computed = {}  # (source, token, k) -> the rank that computed it
    for r in range(W):
        x_RH, arrived = arrived_with_replicas(torch.cat([sent[r] for sent in sent_W]), H, weights_dtype, links[r], None)
        routed, received = arrived.routed, [(s, t) for s in range(W) for t in tokens_W[s][r].tolist()]
        assert x_RH.dtype == hidden_dtype and routed.weights_RK.dtype == weights_dtype
        assert torch.equal(x_RH, torch.stack([hidden_W[s][t] for s, t in received]))
        assert torch.equal(routed.weights_RK, torch.stack([weights_W[s][t] for s, t in received]))
        experts = [r * e + j for j, n in enumerate(routed.pairs.counts_e.tolist()) for _ in range(n)]
        experts += [
            m.expert for m, n in zip(plan.received(r), routed.replica_pairs.counts_e.tolist()) for _ in range(n)
        ]
        for slot, expert in zip(torch.cat([routed.pairs.slot_P, routed.replica_pairs.slot_P]).tolist(), experts):
            (s, t), k = received[slot // K], slot % K
            assert index_W[s][t, k] == expert and (s, t, k) not in computed
            computed[s, t, k] = r
    assert sorted(computed) == [(s, t, k) for s in range(W) for t in range(T) for k in range(K)]
    assert [list(computed.values()).count(r) for r in range(W)] == plan.computed_rows_W()


def test_the_transports_splits_equal_a_loop_over_every_source():
    """The per-rank and the two-level exchange's splits with a plan against each source's rows to each
    helper summed as the hops route them."""
    from epmoe.ep.counts import LayerCounts, NodeSplits
    from epmoe.ep.dispatch import alltoallv, nodes

    rng = random.Random(6)
    for slots_WE, e, replicas, least in random_matrices(rng, 150):
        W = len(slots_WE)
        plan = plan_replicas(slots_WE, e, replicas, least)
        rows_WW = reference_rows_WW(slots_WE, [tuple(m) for m in plan.moves])
        for P in [p for p in (1, 2, 4) if W % p == 0]:
            for rank in range(W):
                base = [rng.randint(0, 9) for _ in range(2 * W)]
                counts = LayerCounts(
                    send_counts_WE=[],
                    recv_counts_WE=[],
                    local_counts_e=[],
                    group=None,
                    global_slots=0,
                    send_rows_W=base[:W],
                    recv_rows_W=base[W:],
                    peer_guards=None,
                    slots_WE=slots_WE,
                )
                send_W, recv_W = alltoallv._replica_splits(counts, plan, rank)
                assert send_W == [a + b for a, b in zip(base[:W], rows_WW[rank])]
                assert recv_W == [base[W + s] + rows_WW[s][rank] for s in range(W)]
                N, node, rail = W // P, rank // P, range(rank % P, W, P)
                splits = NodeSplits([1] * N, [2] * N, [3] * P, [4] * P)
                got = nodes._replica_splits(splits, plan, rank, P)
                assert got.send_nodes_N == [1 + sum(rows_WW[rank][n * P : (n + 1) * P]) for n in range(N)]
                assert got.recv_nodes_N == [2 + sum(rows_WW[s][node * P : (node + 1) * P]) for s in rail]
                assert got.send_ranks_P == [3 + sum(rows_WW[s][node * P + j] for s in rail) for j in range(P)]
                assert got.recv_ranks_P == [4 + sum(rows_WW[s][rank] for s in range(j, W, P)) for j in range(P)]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_replicas_must_be_an_int_at_least_zero(value):
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\(replicas\)"):
        epmoe.ExpertParallelConfig(replicas=value)


@pytest.mark.parametrize(
    "options",
    [{"dispatch": "fused"}, {"dispatch": "static"}, {"capacity_factor": 1.0}],
    ids=lambda o: next(iter(o)) + "=" + str(next(iter(o.values()))),
)
def test_replicas_refuse_what_they_cannot_serve(options):
    with pytest.raises(ValueError, match=r"ExpertParallelConfig\(replicas\)"):
        epmoe.ExpertParallelConfig(replicas=1, **options)
    epmoe.ExpertParallelConfig(replicas=0, **options)


def test_all_combinations_of_small_plans_are_consistent():
    """Every slot matrix of 2 ranks x 2 experts with up to 3 slots each: the plan's counts agree."""
    for values in itertools.product(range(4), repeat=4):
        slots_WE = [list(values[:2]) + [0, 0], [0, 0] + list(values[2:])]
        plan = plan_replicas(slots_WE, 2, 2, 0)
        total_local = sum(sum(plan.local_counts(r)) for r in range(plan.ep_size))
        assert total_local == sum(values) == sum(plan.computed_rows_W())


# --------------------------------------------------------------------------------------------
# multirank: exactness (replica_workers), two spawns

TOL = 1e-10


@pytest.fixture
def two_ranks(tmp_path_factory):
    from ranks import start_ranks
    from replica_workers import two_rank_run

    return start_ranks(two_rank_run, 2, str(tmp_path_factory.getbasetemp() / "replicas"), timeout=600, once=True)


@pytest.fixture
def four_ranks():
    from ranks import start_ranks
    from replica_workers import four_rank_run

    return start_ranks(four_rank_run, 4, timeout=600, once=True)


def assert_exact(result, label, tol=TOL):
    errors = result["errors"]
    assert errors, f"{label}: nothing compared"
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{label}: {worst} relative error {errors[worst]:.3g}"


def assert_module_cases(results, want_moves=True):
    for rank, result in enumerate(results):
        for name, case in result["module"].items():
            for key, err in {**case["errors"], **{f"plain/{k}": v for k, v in case["plain"].items()}}.items():
                assert err <= 1e-12, f"rank {rank} {name}: {key} relative error {err:.3g}"
            for key, nonzero in case["exact_zero"].items():
                assert nonzero == 0, f"rank {rank} {name}: an expert without tokens has a nonzero gradient ({key})"
            assert case["moves"] > 0 or not want_moves, f"rank {rank} {name}: the plan moved nothing"


@pytest.mark.multirank
def test_experts_module_with_replicas_equals_unsharded_and_plain_ep_at_ep2(two_ranks):
    """Skewed (Zipf, one hot expert, one hot rank), uniform, a rank with no tokens, an expert with
    none, fp64: outputs, hidden and routing-weight gradients and every expert gradient."""
    assert_module_cases(two_ranks)


@pytest.mark.multirank
def test_experts_module_with_replicas_at_ep4_uneven(four_ranks):
    assert_module_cases(four_ranks)


@pytest.mark.multirank
def test_bf16_replicas_as_close_to_fp64_as_without(two_ranks):
    for result in two_ranks:
        arms = {arm: max(errors.values()) for arm, errors in result["module_bf16"].items()}
        assert arms["replicas"] <= max(2 * arms["ep"], 3e-2), arms


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", ["ddp", "fsdp2", "checkpointing", "expert_grad_sum", "expert_grad_mean"])
def test_training_with_replicas_equals_without_and_unsharded(two_ranks, recipe):
    """3 AdamW steps (DDP, FSDP2: clipped; gradient checkpointing under DDP; no wrapper in each
    expert_grad mode) on a skewed router, ranks of different batch sizes: losses, logits, every
    gradient, clip norms and parameters against the EP model without replicas and the unsharded
    model; rows computed per rank balanced, routed slots unchanged."""
    for rank, result in enumerate(two_ranks):
        res = result[recipe]
        assert_exact(res, f"rank {rank} {recipe}")
        assert res["moves"] > 0 and res["plain_moves"] == 0, res
        assert res["routed_equal"]
        for name, computed in res["computed"].items():
            without = res["computed_without"][name]
            assert sum(computed) == sum(without) and max(computed) < max(without), (name, computed, without)


@pytest.mark.multirank
def test_training_with_replicas_at_ep4_and_on_an_ep_dp_mesh(four_ranks):
    for rank, result in enumerate(four_ranks):
        for label in ("ddp", "mesh"):
            res = result[label]
            assert_exact(res, f"rank {rank} {label}")
            assert res["moves"] > 0 and res["routed_equal"], res
            assert all(max(c) <= max(w) for c, w in zip(res["computed"].values(), res["computed_without"].values()))


@pytest.mark.multirank
@pytest.mark.parametrize("part", ["lora", "replay"])
def test_lora_on_experts_and_routing_replay_with_replicas(two_ranks, part):
    for rank, result in enumerate(two_ranks):
        assert_exact(result[part], f"rank {rank} {part}")
        assert result[part]["moves"] > 0
    assert two_ranks[0]["lora"]["expert_factors"] > 0


@pytest.mark.multirank
def test_save_pretrained_optimizer_and_dcp_state_with_replicas_equal_without(two_ranks):
    for result in two_ranks:
        save = result["save"]
        assert_exact(save, "save_pretrained")
        assert save["same_keys"] and save["same_optimizer_state"] and save["experts_whole"], save
        assert save["same_dcp_state"], save


@pytest.mark.multirank
def test_checkpointing_of_either_kind_plans_as_the_plain_step(two_ranks):
    """``torch.utils.checkpoint`` reentrant (its forward without gradients) and not: the forward's and
    the recompute's plans move what the plain step's do, the telemetry's moved slots and rows are the
    plain step's, and the loss and every gradient are the plain step's; at this link rate a forward
    without gradients in eval mode (the forward-only cost model) moves nothing."""
    for rank, result in enumerate(two_ranks):
        seen = result["checkpoint_kinds"]
        training, forward_only = seen["keys"]
        assert training < forward_only, seen["keys"]
        plain = seen["plain"]
        assert any(plain["plans"]) and not any(seen["eval_plans"]), (plain["plans"], seen["eval_plans"])
        for kind in ("reentrant", "non_reentrant"):
            case = seen[kind]
            assert sorted(case["plans"]) == sorted(plain["plans"] * 2), (kind, case["plans"], plain["plans"])
            assert case["moved"] == plain["moved"] and case["computed"] == plain["computed"], kind
            assert_exact(case, f"rank {rank} {kind}")


@pytest.mark.multirank
def test_the_cost_model_moves_nothing_at_small_shapes(two_ranks):
    for result in two_ranks:
        seen = result["cost_model"]
        assert seen["plans"] > 0 and seen["moves"] == 0 and seen["logits"] == 0.0, seen


@pytest.mark.parametrize("variant", ["per_route_norm", "biased_module_list"])
def test_experts_that_cannot_lend_their_weights_are_refused_at_apply(variant):
    """Experts that do not run the routed MLP op (a per-expert module after the down projection,
    a ModuleList of experts that run their own forwards) raise at apply, naming the module and
    why, and the model is left as it was."""
    from custom_moe import BiasedExpert, TinyMoELM
    from experts_variants import install

    if variant == "biased_module_list":
        model, where = TinyMoELM(expert_cls=BiasedExpert), "blocks.0.experts"
    else:
        model, where = install(build_model("qwen3_moe"), variant), "model.layers.0.mlp.experts"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"ExpertParallelConfig\(replicas\): \w+ at {where} cannot lend"):
        epmoe.apply_expert_parallel(model, config={"replicas": 1})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert epmoe.ep.state.ep_model(model) is None
    epmoe.apply_expert_parallel(model, config={"replicas": 0})  # the same model without replicas runs


@pytest.mark.multirank
def test_ranks_that_disagree_on_replicas_raise_on_every_rank(two_ranks):
    """At apply (the config), and at a layer call whose plans would differ (the cost model's input)."""
    for result in two_ranks:
        assert result["disagreement"] is not None and "config.replicas" in result["disagreement"], result
        mismatch = result["key_mismatch"]
        assert mismatch is not None and "differently at forward of model.layers.0.mlp.experts" in mismatch, mismatch
        assert "[(144, 144), (48, 48)] by rank" in mismatch, mismatch  # eval's cost model, then training's


@pytest.mark.multirank
def test_generate_with_replicas_gives_the_same_tokens(two_ranks):
    for result in two_ranks:
        seen = result["generate"]
        assert seen["same_tokens"] and seen["logits"] <= TOL and seen["moves"] > 0, seen
