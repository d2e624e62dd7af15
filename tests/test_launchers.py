"""The launchers and idioms users take around an EP model, each against the unsharded model per
parameter (fp64): deep copies (EMA, TRL reference models), groups made after other groups, a rank
that changes dtype alone, a process group with a short timeout, Auto classes, saves under FSDP2,
a Trainer resumed at another world size, parameter counts."""

import pytest

from epmoe.launch import run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    from launcher_workers import launcher_cases

    from epmoe.models import build_model

    root = tmp_path_factory.mktemp("launchers")
    build_model("qwen3_moe").save_pretrained(root / "model")
    return run_ranks(launcher_cases, 2, str(root), timeout=600)


def test_deepcopy_is_an_independent_ep_model(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        case = result["deep_copies"]
        assert case["twin_vs_unsharded"][0] < 1e-10 and case["twin_vs_unsharded"][1] > 10, (rank, case)
        assert case["original_vs_unsharded"][0] < 1e-10, (rank, case)
        assert case["twin_moved"] and case["original_untouched"] and case["copy_is_ep"], (rank, case)
        assert case["reference_model_logits"] < 1e-10 and case["reference_model_frozen"], (rank, case)


def test_a_rank_that_changes_dtype_alone_fails_every_rank_clearly(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        message, seconds = result["dtype_on_one_rank"]
        assert message is not None and "different dtypes" in message, (rank, message)
        assert "torch.float32" in message and "torch.bfloat16" in message and seconds < 20, (rank, message)


def test_epmoe_waits_no_longer_than_a_shorter_process_group_timeout(two_rank_results):
    for result in two_rank_results:
        assert result["shorter_group_timeout"] == (7.0, 7.0, 300.0, 3.0)


def test_from_pretrained_takes_auto_classes(two_rank_results):
    for result in two_rank_results:
        name, same, diff, same_shards = result["auto_class_loading"]
        assert name == "Qwen3MoeForCausalLM" and same and diff == 0.0 and same_shards


def test_groups_do_not_depend_on_what_a_process_did_before():
    from launcher_workers import groups_after_other_groups

    for worst, compared in run_ranks(groups_after_other_groups, 4, timeout=300):
        assert worst < 1e-10 and compared > 10


def test_fsdp2_saves_reload_exactly_in_plain_transformers_and_peft(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        assert result["fsdp2_saves"]["full"] < 1e-10 and result["fsdp2_saves"]["adapter"] < 1e-10, (rank, result)


def test_num_parameters_counts_every_expert(two_rank_results):
    for result in two_rank_results:
        ep_counts, unsharded_counts, counts, expected = result["parameter_counts"]
        assert ep_counts == unsharded_counts and counts == expected


def test_prepared_trainer_resumes_at_another_world_size(tmp_path):
    """checkpoint-2 written at 2 ranks, resumed at 1 (and 1 -> 2): every parameter after step 4 equals
    the unsharded twin's (a plain Trainer resumed the same way)."""
    from launcher_workers import resume_checkpoints

    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run_ranks(resume_checkpoints, 2, two, None, timeout=300)
    run_ranks(resume_checkpoints, 1, one, None, timeout=300)
    for label, world, root, source in (("2 -> 1", 1, f"{one}/resumed", two), ("1 -> 2", 2, f"{two}/resumed", one)):
        for worst, compared, moved in run_ranks(resume_checkpoints, world, root, source, timeout=300):
            assert worst < 1e-10 and compared > 10 and moved > 1e-4, (label, worst, compared, moved)


def test_run_ranks_blames_a_rank_that_exits_with_code_0_without_reporting():
    from launcher_workers import exits_quietly

    from epmoe.launch import RankError

    with pytest.raises(RankError) as caught:
        run_ranks(exits_quietly, 2, timeout=60)
    assert str(caught.value).startswith("rank 1 died with exit code 0 without reporting an error"), str(caught.value)
