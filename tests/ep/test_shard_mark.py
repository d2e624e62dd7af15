"""ShardMark.join on plain tensors, one process: every experts layout epmoe shards (packed experts,
stacked rows, zero-computation experts' unread rows, peft's LoRA factors) rebuilt from its ranks' slices
as the unsharded tensor, and slices that are not the mark's refused by name."""

import pytest
import torch

from epmoe.ep.shard_mark import ShardMark

E, H, I = 4, 6, 3  # experts, hidden, expert width


def slices(whole: torch.Tensor, world: int, narrow) -> list[torch.Tensor]:
    """The parts of ``whole`` that ``world`` ranks hold, ``E / world`` experts each, in rank order:
    ``narrow(whole, start, stop)`` is a rank's part, experts ``[start, stop)``."""
    e = E // world
    return [narrow(whole, r * e, (r + 1) * e) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_experts_join_along_their_experts(world):
    """``(E, 2I, H)``: one row per expert along dim 0."""
    whole = torch.randn(E, 2 * I, H)
    mark = ShardMark((E, 2 * I, H), 0, None, 0, E // world, E)
    assert torch.equal(mark.join(slices(whole, world, lambda t, a, b: t[a:b])), whole)


@pytest.mark.parametrize("world", [2, 4])
def test_stacked_rows_join_with_every_experts_rows(world):
    """DBRX's ``w1`` ``(E*I, H)``: expert ``j`` owns rows ``[j*I, (j+1)*I)``; the mark's global shape is
    ``(E*I, H)`` and each rank's part ``E/W * I`` rows."""
    whole = torch.randn(E * I, H)
    mark = ShardMark((E * I, H), 0, None, 0, E // world, E, rows=I)
    assert torch.equal(mark.join(slices(whole, world, lambda t, a, b: t[a * I : b * I])), whole)


@pytest.mark.parametrize("world", [2, 4])
def test_zero_experts_unread_rows_join_as_zeros(world):
    """Zero-computation experts: the unsharded ``(E+Z, 2I, H)`` has ``Z`` rows past the ``E`` real experts'
    that no expert reads and EP does not keep: joined as zeros (as save_pretrained writes them), the
    real experts' rows as they were, of the unsharded shape."""
    Z = 1
    whole = torch.randn(E + Z, 2 * I, H)
    mark = ShardMark((E + Z, 2 * I, H), 0, None, 0, E // world, E, unread=Z)
    joined = mark.join(slices(whole, world, lambda t, a, b: t[a:b]))
    assert joined.shape == whole.shape
    assert torch.equal(joined[:E], whole[:E]) and not joined[E:].any()


@pytest.mark.parametrize("world", [2, 4])
def test_lora_factors_join_expert_major_and_expert_minor(world):
    """peft's factors: ``lora_A`` ``(r*E, in)`` expert-major (``r`` rows each), ``lora_B`` ``(out, r*E)``
    expert-minor (viewed ``(out, r, e)``, the experts along dim 2)."""
    r, e = 2, E // world
    lora_a = torch.randn(r * E, H)
    mark_a = ShardMark((r * E, H), 0, None, 0, e, E, rows=r)
    assert torch.equal(mark_a.join(slices(lora_a, world, lambda t, a, b: t[a * r : b * r])), lora_a)
    lora_b = torch.randn(2 * I, r * E)
    mark_b = ShardMark((2 * I, r * E), 2, (2 * I, r, e), 0, e, E)
    parts = slices(lora_b, world, lambda t, a, b: t.reshape(2 * I, r, E)[:, :, a:b].reshape(2 * I, r * e))
    assert torch.equal(mark_b.join(parts), lora_b)


def test_parts_that_are_not_the_marks_slices_are_refused_by_name():
    """Too few parts, a part of another number of rows (the stacked-rows tensor marked one row per
    expert), parts of different shapes, a LoRA part that is not the mark's view: ``ValueError`` naming
    ``parts``, never a tensor of another shape."""
    mark = ShardMark((E, 2 * I, H), 0, None, 0, E // 2, E)
    with pytest.raises(ValueError, match=r"ShardMark\.join\(parts\): expected 2 parts .* got 1"):
        mark.join([torch.zeros(E // 2, 2 * I, H)])
    stacked_as_one_row = ShardMark((E, H), 0, None, 0, E // 2, E)
    with pytest.raises(ValueError, match=r"ShardMark\.join\(parts\): expected parts of 2 experts x 1 rows"):
        stacked_as_one_row.join([torch.zeros(E // 2 * I, H)] * 2)
    with pytest.raises(ValueError, match=r"got shapes \[\(2, 6, 6\), \(2, 6, 7\)\]"):
        mark.join([torch.zeros(2, 2 * I, H), torch.zeros(2, 2 * I, H + 1)])
    mark_b = ShardMark((2 * I, 2 * E), 2, (2 * I, 2, E // 2), 0, E // 2, E)
    with pytest.raises(ValueError, match=r"of the view \(6, 2, 2\)"):
        mark_b.join([torch.zeros(2 * I, 3)] * 2)
