"""Routing replay across ranks: recorded at EP 2, replayed at EP 2, at EP 1 and without EP, equal; bad
routes on one rank raise ValueError on every rank."""

import pytest

from epmoe.launch import run_ranks
from replay_workers import bad_routes_on_one_rank, replay_parity


def _cases(rank, world):
    return {"parity": {family: replay_parity(rank, world, family) for family in ("qwen3_moe", "deepseek_v3")},
            "bad": bad_routes_on_one_rank(rank, world)}


@pytest.mark.multirank
def test_replay_is_the_same_at_every_ep_size_and_bad_routes_raise_everywhere():
    per_rank = run_ranks(_cases, 2, timeout=600)
    for rank, result in enumerate(per_rank):
        for family, errors in result["parity"].items():
            assert errors["compared"] > 0
            assert errors["record_during_replay"] == 0, (rank, family)
            assert errors["replay_changes_the_loss"] == 1.0, (rank, family)  # the moved routers choose otherwise
            for key in ("loss_vs_no_ep", "loss_vs_ep1", "grads_vs_no_ep", "grads_vs_ep1"):
                assert errors[key] <= 1e-10, (rank, family, key, errors[key])
        bad = result["bad"]
        assert len(bad) == 2, (rank, bad)
        assert ("not below the experts' count" if rank == 0 else "rank(s) [0]") in bad[0]
        assert ("left over" if rank == 0 else "rank(s) [0]") in bad[1]
