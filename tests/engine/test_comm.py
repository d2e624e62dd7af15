"""Counts exchange, all-to-all-v and the shared-batch sums on real gloo ranks; the launcher's error handling."""

import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from epmoe.comm import all_to_all_v, count_traffic, exchange_counts
from epmoe.comm.reduce import gradients_summed, summed
from epmoe.launch import RankError


def _histogram(rank, world, e):
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 5, (world * e,), generator=g)
    if rank == world - 1:
        counts[:] = 0  # a rank that sends nothing
    return counts


def _exchange_worker(rank, world, e):
    hist = _histogram(rank, world, e)
    send, recv = exchange_counts(hist)
    assert isinstance(send, list) and isinstance(recv, list)
    expected_recv = [int(_histogram(s, world, e)[rank * e + j]) for s in range(world) for j in range(e)]
    assert send == hist.tolist()
    assert recv == expected_recv, (recv, expected_recv)

    # all_to_all_v forward and backward: rows carry their source rank and index
    x = (torch.arange(sum(send), dtype=torch.float64) + 1000 * rank).unsqueeze(1).requires_grad_()
    in_splits = [sum(send[r * e : (r + 1) * e]) for r in range(world)]
    out_splits = [sum(recv[s * e : (s + 1) * e]) for s in range(world)]
    y = all_to_all_v(x, out_splits, in_splits)
    assert y.shape[0] == sum(recv)
    (y * (rank + 1)).sum().backward()
    offsets = [sum(in_splits[:r]) for r in range(world)]
    for r in range(world):
        assert torch.all(x.grad[offsets[r] : offsets[r] + in_splits[r]] == r + 1)

    _check_shared_batch_sums(rank, world)
    if world != 2:  # compiling once is enough
        return True
    # a custom op: torch.compile traces it in one graph (fullgraph), forward and backward alike
    eager_grad, x.grad = x.grad, None
    compiled = torch.compile(lambda t: all_to_all_v(t, out_splits, in_splits) * (rank + 1), fullgraph=True)
    y_compiled = compiled(x)
    y_compiled.sum().backward()
    assert torch.equal(y_compiled.detach(), y.detach() * (rank + 1)) and torch.equal(x.grad, eager_grad)
    return True


def _check_shared_batch_sums(rank, world):
    """``summed``: every rank's part added, its backward the identity; ``gradients_summed``: the
    input unchanged, each rank's partial gradient added in backward; a ring's bytes counted."""
    x = torch.full((3, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    shared = gradients_summed(x, None)
    with count_traffic() as traffic:
        total = summed(shared * (rank + 1), None)
    expected = sum((r + 1) ** 2 for r in range(world))
    assert torch.equal(shared.detach(), x.detach()) and torch.all(total == expected)
    total.sum().backward()  # d total / d x on rank r: (r + 1), summed over the ranks
    assert torch.all(x.grad == sum(r + 1 for r in range(world)))
    assert traffic.bytes_to_peers == 2 * (world - 1) * x.numel() * 8 // world and traffic.exchanges == 1


@pytest.mark.multirank
@pytest.mark.parametrize("world,e", [(2, 3), (3, 1)])
def test_exchange_counts_and_all_to_all(world, e):
    assert start_ranks(_exchange_worker, world, e, timeout=120) == [True] * world


def _bad_worker(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait forever without the launcher
    return rank


@pytest.mark.multirank
def test_launcher_surfaces_first_error_without_hanging():
    with pytest.raises(RankError, match="(?s)rank 1 failed.*rank one is broken"):
        start_ranks(_bad_worker, 2, timeout=60)


def _negative_worker(rank, world):
    counts = torch.ones(world, dtype=torch.int64)
    if rank == 0:
        counts[1] = -1  # only rank 1 receives the bad count; rank 2 sees nothing wrong in its own data
    with pytest.raises(ValueError, match=r"negative counts on rank\(s\) \[0\]"):
        exchange_counts(counts)
    send, recv = exchange_counts(torch.full((world,), rank, dtype=torch.int64))  # still in step afterwards
    return recv


@pytest.mark.multirank
def test_negative_counts_raise_on_every_rank_and_nobody_hangs():
    assert start_ranks(_negative_worker, 3, timeout=60) == [[0, 1, 2]] * 3


def test_exchange_counts_validation():
    with pytest.raises(TypeError, match="tokens_per_expert"):
        exchange_counts([1, 2])
    with pytest.raises(ValueError, match="integer"):
        exchange_counts(torch.ones(4))
    send, recv = exchange_counts(torch.tensor([3, 0, 2]))  # no process group: a group of one
    assert send == recv == [3, 0, 2]
    with pytest.raises(ValueError, match="negative"):
        exchange_counts(torch.tensor([3, -1]))


def test_shared_batch_sums_validation():
    with pytest.raises(TypeError, match=r"summed\(partial\)"):
        summed([1.0], None)
    with pytest.raises(TypeError, match=r"gradients_summed\(x\)"):
        gradients_summed(3, None)
