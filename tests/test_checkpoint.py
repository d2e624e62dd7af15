"""Checkpoints of EP models: save_pretrained on every rank writes what a plain save writes."""

import pytest

from checkpoint_workers import save_checks
from epmoe.launch import run_ranks

pytest.importorskip("transformers")


def test_save_pretrained_writes_every_expert(tmp_path):
    """2 ranks, EP=2: the same keys, shapes, dtypes, config.json and sharded index (its total_parameters
    the full model's) as a plain save of the unsharded model; plain from_pretrained reloads every weight
    bitwise and reproduces the EP model's logits (fp32, 1e-6)."""
    for rank, by_case in enumerate(run_ranks(save_checks, 2, str(tmp_path), timeout=300)):
        for case, result in by_case.items():
            assert result["same_tensors"] and result["same_config"] and result["same_index"], (rank, case, result)
            assert result["weights_equal"], (rank, case)
            assert result["logits_error"] <= 1e-6, (rank, case, result["logits_error"])
        sharded = by_case["qwen3_moe_sharded"]
        assert sharded["sharded"] and sharded["total_parameters"] == sharded["ref_parameters"]
