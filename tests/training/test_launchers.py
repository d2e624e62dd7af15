"""The launchers and idioms users take around an EP model, each against the unsharded model per
parameter (fp64): deep copies (EMA, TRL reference models), groups made after other groups, a rank
that changes dtype alone, a process group with a short timeout, Auto classes, saves under FSDP2,
a Trainer resumed at another world size, parameter counts. And the launcher table
(epmoe.training.launchers): every method of another library that epmoe replaces, overrides or calls
still exists with the signature it was checked against; epmoe keeps what it remembers about other
libraries' objects in one registry, not in attributes on them."""

import dataclasses
import gc
import importlib.metadata
import os
import re
import time
import types
import weakref

import pytest
from packaging.version import Version
from ranks import start_ranks

from epmoe.launch import run_ranks
from epmoe.training.launchers import CHECKED_AGAINST, TABLE, entries_to_check, replace, signature_text


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    from launcher_workers import launcher_cases

    from epmoe.models import build_model

    root = tmp_path_factory.mktemp("launchers")
    build_model("qwen3_moe").save_pretrained(root / "model")
    return start_ranks(launcher_cases, 2, str(root), timeout=600)


@pytest.mark.multirank
def test_deepcopy_is_an_independent_ep_model(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        case = result["deep_copies"]
        assert case["twin_vs_unsharded"][0] < 1e-10 and case["twin_vs_unsharded"][1] > 10, (rank, case)
        assert case["original_vs_unsharded"][0] < 1e-10, (rank, case)
        assert case["twin_moved"] and case["original_untouched"] and case["copy_is_ep"], (rank, case)
        assert case["reference_model_logits"] < 1e-10 and case["reference_model_frozen"], (rank, case)


@pytest.mark.multirank
def test_a_rank_that_changes_dtype_alone_fails_every_rank_clearly(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        message, seconds = result["dtype_on_one_rank"]
        assert message is not None and "different dtypes" in message, (rank, message)
        assert "torch.float32" in message and "torch.bfloat16" in message and seconds < 20, (rank, message)


@pytest.mark.multirank
def test_epmoe_waits_no_longer_than_a_shorter_process_group_timeout(two_rank_results):
    for result in two_rank_results:
        assert result["shorter_group_timeout"] == (7.0, 7.0, 300.0, 3.0)


@pytest.mark.multirank
def test_from_pretrained_takes_auto_classes(two_rank_results):
    for result in two_rank_results:
        name, same, diff, same_shards = result["auto_class_loading"]
        assert name == "Qwen3MoeForCausalLM" and same and diff == 0.0 and same_shards


@pytest.mark.multirank
def test_groups_do_not_depend_on_what_a_process_did_before():
    from launcher_workers import groups_after_other_groups

    for worst, compared in start_ranks(groups_after_other_groups, 4, timeout=300):
        assert worst < 1e-10 and compared > 10


@pytest.mark.multirank
def test_fsdp2_saves_reload_exactly_in_plain_transformers_and_peft(two_rank_results):
    for rank, result in enumerate(two_rank_results):
        assert result["fsdp2_saves"]["full"] < 1e-10 and result["fsdp2_saves"]["adapter"] < 1e-10, (rank, result)


@pytest.mark.multirank
def test_num_parameters_counts_every_expert(two_rank_results):
    for result in two_rank_results:
        ep_counts, unsharded_counts, counts, expected = result["parameter_counts"]
        assert ep_counts == unsharded_counts and counts == expected


@pytest.mark.multirank
def test_prepared_trainer_resumes_at_another_world_size(tmp_path):
    """checkpoint-2 written at 2 ranks, resumed at 1 (and 1 -> 2): every parameter after step 4 equals
    the unsharded twin's (a plain Trainer resumed the same way)."""
    from launcher_workers import resume_checkpoints

    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    start_ranks(resume_checkpoints, 2, two, None, timeout=300)
    start_ranks(resume_checkpoints, 1, one, None, timeout=300)
    for label, world, root, source in (("2 -> 1", 1, f"{one}/resumed", two), ("1 -> 2", 2, f"{two}/resumed", one)):
        for worst, compared, moved in start_ranks(resume_checkpoints, world, root, source, timeout=300):
            assert worst < 1e-10 and compared > 10 and moved > 1e-4, (label, worst, compared, moved)


@pytest.mark.multirank
def test_run_ranks_blames_a_rank_that_exits_with_code_0_without_reporting():
    from launcher_workers import exits_quietly

    from epmoe.launch import RankError

    with pytest.raises(RankError) as caught:
        run_ranks(exits_quietly, 2, timeout=60)
    assert str(caught.value).startswith("rank 1 died with exit code 0 without reporting an error"), str(caught.value)


@pytest.mark.multirank
def test_run_ranks_start_methods_give_fresh_ranks_the_callers_environment(monkeypatch):
    """Both start methods: new processes each call, the caller's environment variables as they are
    at the call (forkserver: not the server's from when it started); a bad method is refused by name."""
    from launcher_workers import what_a_rank_sees

    for method in ("spawn", "forkserver", "forkserver"):
        monkeypatch.setenv("EPMOE_PROBE", f"{method} {time.monotonic()}")
        seen = run_ranks(what_a_rank_sees, 2, timeout=120, start_method=method)
        assert [probe for _, probe in seen] == [os.environ["EPMOE_PROBE"]] * 2, (method, seen)
        assert len({pid for pid, _ in seen} | {os.getpid()}) == 3, (method, seen)
    with pytest.raises(ValueError, match=r"run_ranks\(start_method\).*'fork'"):
        run_ranks(what_a_rank_sees, 2, start_method="fork")


def _installed(library):
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.parametrize("entry, owner", entries_to_check(), ids=lambda x: getattr(x, "method", x))
def test_launcher_table_methods_exist_with_the_recorded_signature(entry, owner):
    """Fails when a library epmoe adapts to drops or changes a method the table lists: reread the
    adaptation against the new version, then update the table and CHECKED_AGAINST."""
    library = owner.split(".")[0]
    if _installed(library) is None:
        pytest.skip(f"{library} is not installed")
    if entry.since and Version(_installed(entry.library)) < Version(
        entry.since
    ):  # the release epmoe leaves it alone in
        try:
            method = dataclasses.replace(entry, owner=owner).resolve()
        except (ImportError, AttributeError, RuntimeError):  # RuntimeError: trl's lazy import failing
            return
        assert signature_text(method) != entry.signature, f"{owner}.{entry.method} is there before {entry.since}"
        return
    method = dataclasses.replace(entry, owner=owner).resolve()
    assert signature_text(method) == entry.signature, (
        f"{owner}.{entry.method} changed signature in {library} {_installed(library)} (table checked against "
        f"{CHECKED_AGAINST[entry.library]}): {signature_text(method)} != {entry.signature}"
    )


def test_launcher_table_names_the_versions_it_was_checked_against():
    assert set(CHECKED_AGAINST) == {"transformers", "accelerate", "deepspeed", "trl"}
    assert {entry.library for entry in TABLE} <= set(CHECKED_AGAINST)
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", version) for version in CHECKED_AGAINST.values())


def test_launcher_table_check_sees_a_changed_or_missing_method():
    """The check above can fail: a recorded signature that differs, and a method that is gone."""
    pytest.importorskip("accelerate")
    changed = dataclasses.replace(TABLE[0], signature="(self, parameters, max_norm)")
    assert signature_text(changed.resolve()) != changed.signature
    with pytest.raises(AttributeError):
        dataclasses.replace(TABLE[0], method="clip_grad_norm_gone").resolve()


def test_only_methods_in_the_table_are_replaced():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(LookupError, match="not in the launcher table"):
        replace(accelerator, "backward", lambda loss: None)


def test_prepare_accelerator_remembers_in_the_registry_not_on_the_accelerator():
    """No epmoe attribute on the accelerator; a second call is a no-op; the registry forgets the
    accelerator with it."""
    accelerate = pytest.importorskip("accelerate")
    import epmoe

    accelerator = epmoe.prepare_accelerator(accelerate.Accelerator(cpu=True))
    clip = accelerator.clip_grad_norm_
    assert epmoe.prepare_accelerator(accelerator).clip_grad_norm_ is clip
    assert not [name for name in vars(accelerator) if "epmoe" in name]
    ref = weakref.ref(accelerator)
    del accelerator, clip
    gc.collect()
    assert ref() is None


def test_unsplit_deepspeed_param_groups_name_the_fix():
    """Expert parameters (marked for DeepSpeed) outside a MoE group, or a MoE group holding others:
    epmoe's ValueError naming prepare_deepspeed and DeepSpeed's split helper."""
    import torch

    from epmoe.training.deepspeed import check_moe_param_groups

    expert, dense = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    check_moe_param_groups([{"params": [dense]}, {"params": [expert], "moe": True, "name": "ep_size_2"}], "here")
    for groups in ([{"params": [dense, expert]}], [{"params": [dense]}, {"params": [expert, dense], "moe": True}]):
        with pytest.raises(ValueError, match="epmoe.prepare_deepspeed") as caught:
            check_moe_param_groups(groups, "here")
        assert "split_params_into_different_moe_groups_for_optimizer" in str(caught.value)


def test_prepare_trainer_replaces_only_methods_in_the_table_and_sets_no_other_attribute(tmp_path):
    """What prepare_trainer adds to the Trainer and its accelerator is methods of the table, once (a
    second call changes nothing), and one TrainerCallback."""
    transformers = pytest.importorskip("transformers")
    import epmoe
    from epmoe.models import build_model
    from epmoe.training.launchers import REPLACED

    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    trainer = transformers.Trainer(
        model=model, args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    )
    before = set(vars(trainer)), set(vars(trainer.accelerator))
    assert epmoe.prepare_trainer(trainer) is trainer
    after = dict(vars(trainer)), dict(vars(trainer.accelerator))
    assert epmoe.prepare_trainer(trainer) is trainer
    assert (dict(vars(trainer)), dict(vars(trainer.accelerator))) == after
    added = (set(after[0]) - before[0]) | (set(after[1]) - before[1])
    assert added and added <= {entry.method for entry in TABLE if entry.how == REPLACED}, added
    callbacks = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
    assert callbacks.count("DcpCheckpoint") == 1, callbacks


def test_moe_param_groups_are_split_with_deepspeeds_helper():
    """Each group's expert parameters move to a MoE group of their own with the group's options (what
    split_params_into_different_moe_groups_for_optimizer makes); the other groups keep theirs."""
    pytest.importorskip("deepspeed")
    import torch

    from epmoe.training.deepspeed import check_moe_param_groups, split_moe_param_groups

    dense, expert, bias = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    optimizer = torch.optim.AdamW(
        [{"params": [dense, expert], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}], lr=1e-3
    )
    split_moe_param_groups(optimizer, "here")
    groups = [
        ({k: v for k, v in g.items() if k in ("name", "moe", "weight_decay")}, [id(p) for p in g["params"]])
        for g in optimizer.param_groups
    ]
    assert groups == [
        ({"weight_decay": 0.1}, [id(dense)]),
        ({"weight_decay": 0.0}, [id(bias)]),
        ({"weight_decay": 0.1, "name": "ep_size_2", "moe": True}, [id(expert)]),
    ], groups
    check_moe_param_groups(optimizer.param_groups, "here")


def test_replay_rollout_routing_refuses_a_grpo_trainer_of_another_trl(monkeypatch):
    """A trl whose GRPOTrainer lacks or changed a method the replay replaces (older than 1.16) is refused
    naming the release, before anything is replaced."""
    from epmoe.training import grpo

    first = next(entry for entry in grpo.TABLE if entry.owner == "trl.GRPOTrainer")
    changed = tuple(dataclasses.replace(e, signature="(self)") if e is first else e for e in grpo.TABLE)
    monkeypatch.setattr(grpo, "TABLE", changed)
    trainer = types.SimpleNamespace(_generate_and_score_completions=lambda inputs: None, model=None)
    with pytest.raises(ValueError, match=r"GRPOTrainer differs in \['_generate_single_turn'.*use trl >= 1\.16"):
        grpo.replay_rollout_routing(trainer)
    assert "_generate_single_turn" not in vars(trainer)
