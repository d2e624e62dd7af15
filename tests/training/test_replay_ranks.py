"""Routing replay across ranks: recorded at EP 2, replayed at EP 2, at EP 1 and without EP, equal; bad
routes on one rank raise ValueError on every rank; TRL's GRPO replaying its rollouts' routes at EP 2 equals
the same GRPO without EP (DDP), every parameter."""

import pytest
from ranks import start_ranks
from replay_workers import bad_routes_on_one_rank, replay_parity


def _cases(rank, world, out_dir):
    from grpo_workers import grpo_replay_parity

    return {
        "parity": {family: replay_parity(rank, world, family) for family in ("qwen3_moe", "deepseek_v3")},
        "bad": bad_routes_on_one_rank(rank, world),
        "grpo": grpo_replay_parity(rank, world, out_dir),
    }


@pytest.mark.multirank
def test_replay_is_the_same_at_every_ep_size_and_bad_routes_raise_everywhere(tmp_path):
    per_rank = start_ranks(_cases, 2, str(tmp_path), timeout=900)
    for rank, result in enumerate(per_rank):
        for family, errors in result["parity"].items():
            assert errors["compared"] > 0
            assert errors["record_during_replay"] == 0, (rank, family)
            assert errors["replay_changes_the_loss"] == 1.0, (rank, family)  # the moved routers choose otherwise
            for key in ("loss_vs_no_ep", "loss_vs_ep1", "grads_vs_no_ep", "grads_vs_ep1"):
                assert errors[key] <= 1e-10, (rank, family, key, errors[key])
        bad = result["bad"]
        assert len(bad) == 3, (rank, bad)
        assert ("not below the experts' count" if rank == 0 else "rank(s) [0]") in bad[0]
        assert ("left over" if rank == 0 else "rank(s) [0]") in bad[1]
        if rank == 0:  # rank 1 raised inside the block: rank 0 is told at the block's end
            assert bad[2].startswith("ValueError") and "rank(s) [1]" in bad[2], bad[2]
        else:  # its own exception goes on
            assert bad[2] == "RuntimeError: the user's code failed", bad[2]
        grpo = result["grpo"]
        assert grpo["max_rel"] <= 1e-9 and grpo["moved"] > 1e-3, (rank, grpo)  # two Adam steps in fp64
        for run in ("ep", "ddp"):
            assert grpo[run]["replayed"] == 2 and grpo[run]["routes_followed"], (rank, run, grpo[run])
        assert grpo["ep"]["flips"] > 0  # the routers alone would have routed otherwise: the replay did it
    lengths = per_rank[0]["grpo"]["lengths_by_rank"]
    assert lengths[0] != lengths[1]  # completions of different lengths on the two ranks
