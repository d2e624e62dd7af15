"""The launchers and idioms users take around an EP model, each against the unsharded model per
parameter (fp64): deep copies (EMA, TRL reference models), groups made after other groups, a rank
that changes dtype alone, a process group with a short timeout, Auto classes."""

import pytest

from epmoe.launch import run_ranks

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    from launcher_workers import launcher_cases

    from epmoe.models import build_model

    path = tmp_path_factory.mktemp("auto") / "model"
    build_model("qwen3_moe").save_pretrained(path)
    return run_ranks(launcher_cases, 2, str(path), timeout=600)


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
