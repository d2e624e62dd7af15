"""Training with the tools users already use, each recipe against the same recipe without EP.

2 gloo ranks for DDP (plain and with nn.ModuleList experts), expert_grad modes, expert-parameter
identity (PEFT LoRA on experts), refusals and generate, batched in one spawn; 4 ranks for EP x DP.
Exactness is claimed in float64: relative 1e-10.
"""

import functools

import pytest
from ranks import start_ranks
from training_workers import ep_dp_mesh, trainer_parity_both, two_rank_checks

pytest.importorskip("transformers")
pytest.importorskip("peft")

TOL = 1e-10


@functools.lru_cache(maxsize=1)
def two_rank_results():
    return start_ranks(two_rank_checks, 2, timeout=400)


def results_of(check):
    out = [ranks[check] for ranks in two_rank_results()]
    for rank, result in enumerate(out):
        assert not (isinstance(result, dict) and "error" in result), f"rank {rank}:\n{result['error']}"
    return out


def assert_errors(errors, rank, tol=TOL):
    assert errors, f"rank {rank}: nothing compared"
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"rank {rank}: {len(bad)} of {len(errors)} above {tol}: {dict(list(bad.items())[:6])}"


@pytest.mark.multirank
def test_ddp_equals_non_ep_ddp_per_parameter():
    """DDP(ep_model) with no other code, AdamW x 5, per-rank batch sizes differ, clipped every step:
    DDP neither broadcast nor reduced the experts; step-0 gradients, every clip norm (2, 1 and inf)
    and the parameters after 5 steps equal the non-EP DDP run's, per parameter."""
    results = results_of("ddp")
    assert results[0]["facts"]["norms"] == results[1]["facts"]["norms"]  # the same clip norm on every rank
    for rank, result in enumerate(results):
        errors, facts = result["errors"], result["facts"]
        assert_errors(errors, rank)
        assert any(k.startswith("param/") and ".experts." in k for k in errors)
        assert not facts["ddp_reduces_experts"] and facts["num_experts_params"] == 4
        assert facts["clipped"], facts["norms"]  # the clip factor mattered at every step
        assert facts["log"] == [
            "epmoe: expert_grad='auto' -> 'mean' (DistributedDataParallel): expert gradients "
            "are divided by the 2 data-parallel ranks"
        ], facts["log"]


@pytest.mark.multirank
def test_ddp_with_module_list_experts():
    for rank, errors in enumerate(results_of("ddp_module_list")):
        assert_errors(errors, rank)
        assert any("biased/param/blocks.0.experts" in k for k in errors)


@pytest.mark.multirank
def test_ddp_gpt_oss_biased_transposed_experts():
    for rank, errors in enumerate(results_of("ddp_gpt_oss")):
        assert_errors(errors, rank)
        assert any("experts.down_proj_bias" in k for k in errors)


@pytest.mark.multirank
def test_expert_grad_modes_without_wrapper():
    """ "sum" and "auto" (no wrapper) give the unsharded model's expert gradients on the concatenated
    batch; "mean" those divided by the 2 ranks; non-expert gradients are the rank's own."""
    for rank, errors in enumerate(results_of("expert_grad_modes")):
        assert_errors(errors, rank)
        assert {k.split("/")[0] for k in errors} == {"sum", "auto", "mean"}


@pytest.mark.multirank
def test_expert_parameters_by_identity_with_lora():
    for result in results_of("identity"):
        assert result["base"] == 4  # 2 layers x (gate_up_proj, down_proj)
        assert len(result["lora"]) == 8 and all("experts" in n and "lora_" in n for n in result["lora"])
        assert result["all_marked"] and not result["attention_marked"]
        assert not result["ddp_reduces_experts"] and result["ddp_reduces_attention_lora"]


@pytest.mark.multirank
def test_refusals():
    for result in results_of("refusals"):
        assert "apply expert parallelism first" in result["ddp"] and "DistributedDataParallel" in result["ddp"]
        assert "apply expert parallelism first" in result["fsdp2"] and "FSDP2" in result["fsdp2"]
        assert result["synced_false"] and "synced_gpus" in result["synced_false"]


@pytest.mark.multirank
def test_generate_ranks_stop_at_different_steps():
    results = results_of("generate")
    assert [r["new_tokens"] for r in results] == [3, 9]
    for result in results:
        assert result["greedy_equal"] and result["sampled_reproducible"] and result["sampled_equal_ref"], result


@pytest.mark.multirank
def test_ep_x_dp_mesh_four_ranks():
    """("dp", "ep") = (2, 2): equals 4-rank non-EP DDP per parameter (AdamW x 4, clipped), replicas
    over "dp" bitwise identical; the same with ModuleList experts, and with frozen expert weights
    (which get no gradient)."""
    for rank, result in enumerate(start_ranks(ep_dp_mesh, 4, timeout=300)):
        assert result["ep_size"] == 2
        assert_errors(result["errors"], rank)
        assert result["replicas_equal"]


@pytest.mark.multirank
def test_trainer_defaults_are_exact(tmp_path):
    """Trainer (a subclass, through prepare_trainer) on the EP model vs a plain Trainer on the unsharded
    model: AdamW, max_grad_norm=1.0 (it clips: logged norms > 1), gradient checkpointing, accumulation
    2, evaluate(). After 6 steps: every parameter (float64: 1e-10 element-wise; float32: 1e-5 of each
    tensor's 2-norm), the logged grad norms and losses, and the eval loss; replicated weights stay
    identical across ranks; Trainer.save_model writes every expert (plain from_pretrained reloads
    the EP model's weights exactly)."""
    for rank, by_dtype in enumerate(start_ranks(trainer_parity_both, 2, str(tmp_path), timeout=400)):
        for dtype, tol in (("float64", TOL), ("float32", 1e-5)):
            result = by_dtype[dtype]
            assert result["num_steps"] == 6 and result["checkpointing"], dtype
            assert min(result["norms"]) > 1.0, result["norms"]
            assert_errors(result["errors"], rank, tol=tol)
            assert result["replicated_equal"], dtype


@pytest.mark.multirank
def test_trainer_resume_from_checkpoint_is_exact(tmp_path):
    """Trainer checkpoints of an EP model (through prepare_trainer) resume exactly: a fresh run from
    checkpoint-4 ends with the uninterrupted run's parameters and step 5-6 losses (fp64)."""
    from training_workers import trainer_resume

    for rank, errors in enumerate(start_ranks(trainer_resume, 2, str(tmp_path), timeout=300)):
        assert_errors(errors, rank)
        assert any(".experts." in k for k in errors)


@pytest.mark.parametrize(
    "option",
    [{"save_on_each_node": True}, {"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}],
)
def test_prepare_trainer_refuses_what_it_cannot_make_exact(option, tmp_path):
    import torch
    from transformers import Trainer, TrainingArguments

    import epmoe
    from epmoe.models import build_model

    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **option)
    rows = torch.randint(0, 256, (4, 8))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in rows],
        eval_dataset=[{"input_ids": r, "labels": r} for r in rows],
    )
    with pytest.raises(ValueError, match=next(iter(option))):
        epmoe.prepare_trainer(trainer)


def test_prepare_trainer_needs_an_ep_model(tmp_path):
    from transformers import Trainer, TrainingArguments

    import epmoe
    from epmoe.models import build_model

    trainer = Trainer(
        model=build_model("qwen3_moe"), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    )
    with pytest.raises(ValueError, match="apply_expert_parallel"):
        epmoe.prepare_trainer(trainer)
    with pytest.raises(TypeError, match="trainer"):
        epmoe.prepare_trainer(object())


def test_public_functions_validate_their_arguments():
    import math

    import torch

    import epmoe

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    for bad, arg in ((-1.0, "max_norm"), ("1", "max_norm")):
        with pytest.raises(ValueError, match=arg):
            epmoe.clip_grad_norm_([p], bad)
    with pytest.raises(ValueError, match="norm_type"):
        epmoe.clip_grad_norm_([p], 1.0, norm_type=0)
    with pytest.raises(TypeError, match="parameters_or_model"):
        epmoe.clip_grad_norm_([p, 3], 1.0)
    # outside any process group: torch's own result
    assert epmoe.clip_grad_norm_([p], math.inf).item() == pytest.approx(torch.full((3,), 2.0).norm().item())
    with pytest.raises(TypeError, match="model"):
        epmoe.expert_parameters("model")
    with pytest.raises(TypeError, match="param"):
        epmoe.is_expert_parameter(3)
    with pytest.raises(TypeError, match="model"):
        epmoe.get_state_dict(None)
    with pytest.raises(TypeError, match="model_class"):
        epmoe.from_pretrained(3, "path")
    with pytest.raises(ValueError, match="expert_grad"):
        epmoe.ExpertParallelConfig(expert_grad="average")


def test_synced_generate_reads_as_the_bound_generate_it_replaces():
    """Frameworks look at ``model.generate`` as a bound method: LLaMA-Factory's ``patch_model`` reads
    ``model.generate.__func__`` and, where it does not name GenerationMixin, rebinds GenerationMixin's
    (which would drop the synced default). The stand-in answers as the method it replaces."""
    from transformers import GenerationMixin

    from epmoe.models import build_model
    from epmoe.training.generate import SyncedGenerate

    model = build_model("qwen3_moe")
    synced = SyncedGenerate(model)
    assert synced.__self__ is model and synced.__func__ is type(model).generate is GenerationMixin.generate
    assert "GenerationMixin" in str(synced.__func__)  # LLaMA-Factory's test, which keeps it


def test_resuming_a_checkpoint_without_epmoe_dcp_is_refused_by_name(tmp_path):
    """A checkpoint a Trainer wrote without EP (LLaMA-Factory's run without ``epmoe run``, say) has no
    ``epmoe_dcp/``; its optimizer file is not read in its place."""
    from epmoe.training.trainer import _dcp_dir

    (tmp_path / "checkpoint-2").mkdir()
    with pytest.raises(ValueError, match=r"checkpoint-2 has no epmoe_dcp/: it was not written by a prepared Trainer"):
        _dcp_dir(str(tmp_path / "checkpoint-2"), must_exist=True)
    (tmp_path / "checkpoint-2" / "epmoe_dcp").mkdir()
    assert _dcp_dir(str(tmp_path / "checkpoint-2"), must_exist=True) == str(tmp_path / "checkpoint-2" / "epmoe_dcp")
