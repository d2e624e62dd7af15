"""epmoe.comm.layout: the row orders against a per-row reference, on random counts (empty experts,
ranks that receive nothing, everything on one expert)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epmoe.comm.layout import RowLayout, inverse_permutation, prefix, round_bounds, rows_index


@st.composite
def plans(draw):
    world, e = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["random", "zeros", "one expert"]))
    if kind == "zeros":
        recv = [0] * (world * e)
    elif kind == "one expert":
        recv = [0] * (world * e)
        recv[draw(st.integers(0, world * e - 1))] = draw(st.integers(1, 9))
    else:
        recv = draw(st.lists(st.integers(0, 5), min_size=world * e, max_size=world * e))
    send = draw(st.lists(st.integers(0, 5), min_size=world * e, max_size=world * e))
    return RowLayout.one_round(world, e, send, recv)


def _source_major_rows(plan):
    """``(s, j, i)`` of every received row in arrival order: source-major."""
    return [
        (s, j, i)
        for s in range(plan.ep_size)
        for j in range(plan.e)
        for i in range(plan.counts_expert_major_WE[s * plan.e + j])
    ]


@settings(max_examples=200, deadline=None)
@given(plans())
def test_permutations_match_a_per_row_reference(plan):
    rows = _source_major_rows(plan)
    expert_major = sorted(rows, key=lambda row: (row[1], row[0], row[2]))  # (j, s), arrival order within
    to_expert = rows_index(plan.to_expert_major(0, plan.e), plan.rows_expert_major)
    to_source = rows_index(plan.to_source_major(0, plan.e), plan.rows_expert_major)
    assert [rows[i] for i in to_expert.tolist()] == expert_major
    assert [expert_major[i] for i in to_source.tolist()] == rows  # the inverse
    assert torch.equal(inverse_permutation(to_expert), to_source)
    assert to_expert.dtype == torch.int64 and to_expert.numel() == len(rows)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_splits_offsets_and_group_sizes(plan):
    W, e = plan.ep_size, plan.e
    send, recv = plan.counts_rank_major_WE, plan.counts_expert_major_WE
    assert plan.rank_major_splits == [sum(send[r * e : (r + 1) * e]) for r in range(W)]
    assert plan.expert_major_splits_W == [sum(recv[s * e : (s + 1) * e]) for s in range(W)]
    assert plan.rows_per_expert_e == [sum(recv[s * e + j] for s in range(W)) for j in range(e)]
    assert plan.offsets_expert == prefix(plan.rows_per_expert_e) and plan.offsets_expert[0] == 0
    assert plan.rows_rank_major == sum(send) and plan.rows_expert_major == sum(recv)


def test_rows_index_of_no_blocks_and_rounds():
    assert rows_index([], 0).tolist() == []
    assert rows_index([(3, 2), (0, 1), (5, 0)], 3).tolist() == [3, 4, 0]
    assert round_bounds(5, 2) == [(0, 2), (2, 5)] and round_bounds(2, 8) == [(0, 1), (1, 2)]
