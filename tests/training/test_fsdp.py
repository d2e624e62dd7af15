"""transformers' Trainer under accelerate's FSDP2 plugin configured the HF way, through prepare_trainer.

One spawn of 2 gloo ranks runs every case (tests/training/fsdp_workers.py). accelerate honours the FSDP plugin
only on a multi-accelerator distributed type; the workers make it decide as on a GPU machine, in
the rank processes only, while each Trainer builds its Accelerator (``fsdp_workers.as_on_gpus``), so
FSDP2 runs on the CPU over gloo. Exactness is claimed in float64 against the same Trainer recipe
(same FSDP2 config) on the unsharded model: relative 1e-10, per parameter.
"""

import functools

import pytest
from fsdp_workers import MAX_GRAD_NORM, two_rank_checks
from rank_checks import of
from ranks import start_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOL = 1e-10


@functools.lru_cache(maxsize=1)
def results(tmp_dir):
    return start_ranks(two_rank_checks, 2, tmp_dir, timeout=500)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("fsdp")))


def test_prepared_trainer_under_hf_fsdp2_config_equals_the_unsharded_model(out):
    """TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, ...}) on both: the EP
    model through prepare_trainer vs the unsharded model through a plain Trainer. AdamW x 4 steps,
    accumulation 2, max_grad_norm 0.5 (it clips at every step): every parameter, the logged grad norms
    (the whole model's) and losses, the eval loss; FSDP2 really sharded every non-expert parameter
    and left the experts plain; save_model wrote a checkpoint plain from_pretrained reloads with every
    weight equal to the reference's."""
    results = of(out, "parity")
    assert results[0]["norms"] == results[1]["norms"]
    for rank, result in enumerate(results):
        assert result["distributed"].endswith("FSDP"), result["distributed"]
        kinds = result["kinds"]
        assert kinds.get("expert/plain", 0) >= 2 and kinds.get("other/dtensor", 0) >= 10, kinds
        assert "expert/dtensor" not in kinds and "other/plain" not in kinds, kinds
        errors = result["errors"]
        assert sum(k.startswith("param/") for k in errors) == sum(v for k, v in kinds.items())
        assert any(k.startswith("param/") and ".experts." in k for k in errors)
        assert sum(k.startswith("saved/") for k in errors) == sum(k.startswith("param/") for k in errors)
        assert len([k for k in errors if k.startswith("grad_norm/")]) == 4
        assert len([k for k in errors if k.startswith("loss/")]) == 4 and "eval_loss" in errors
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert min(result["norms"]) > MAX_GRAD_NORM, result["norms"]  # the clip factor mattered at every step
        assert "model.safetensors" in result["files"] or "model.safetensors.index.json" in result["files"]


@pytest.mark.parametrize(
    "case, words",
    [
        ("fsdp1", ["FSDP1", "version': 2"]),
        ("cpu_ram_efficient_loading", ["cpu_ram_efficient_loading", "rank 0's"]),
        ("ignored_modules_wrong", ["ignored_modules", "experts.gate_up_proj", "self_attn.q_proj", "leave it unset"]),
    ],
)
def test_prepare_trainer_refuses_what_fsdp_cannot_make_exact(out, case, words):
    for result in of(out, case):
        assert result["fsdp"], result
        assert result["error"] is not None, result
        for word in words:
            assert word in result["error"], (word, result["error"])


def test_trainer_checkpoints_under_hf_fsdp2_config_resume_exactly(out):
    """save_strategy="steps" under the FSDP2 config: a fresh prepared Trainer resumed from checkpoint-2
    ends with the uninterrupted run's parameters and step 3-4 losses (fp64); the checkpoint holds
    epmoe's DCP state and no FSDP plugin files (which would hold rank 0's experts only)."""
    for rank, result in enumerate(of(out, "resume")):
        errors = result["errors"]
        assert sum(k.startswith("param/") for k in errors) >= 10 and any(".experts." in k for k in errors)
        assert len([k for k in errors if k.startswith("loss/")]) == 2
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert "epmoe_dcp" in result["files"] and not any("fsdp" in f for f in result["files"]), result["files"]
