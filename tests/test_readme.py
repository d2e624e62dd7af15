"""Every recipe in the README's Training section runs as written, on the ranks it says.

A recipe is a ```python block preceded by ``<!-- recipe: NAME ranks=N -->``: it defines ``NAME(rank,
world)``. The blocks are written to one module, in README order, and each function is called on
every rank of a fresh process group (one spawn per rank count). Correctness of each recipe against
the same recipe without EP is checked in tests/test_training.py and tests/test_compose.py.
"""

import re
from pathlib import Path

import pytest
import torch

from epmoe.launch import run_ranks
from readme_recipes import run_recipes

pytest.importorskip("transformers")

README = Path(__file__).resolve().parent.parent / "README.md"
RECIPE = re.compile(r"<!-- recipe: (\w+) ranks=(\d+) -->\n```python\n(.*?)```", re.S)


def recipes():
    found = RECIPE.findall(README.read_text())
    assert found, "no recipes in the README"
    return [(name, int(ranks), code) for name, ranks, code in found]


def test_readme_lists_the_training_recipes():
    assert [name for name, _, _ in recipes()] == [
        "migrate_distributed_config",
        "train_ddp",
        "train_fsdp2",
        "train_ep_dp",
        "train_trainer",
        "train_accelerate",
        "train_deepspeed",
        "generate",
        "train_compiled",
        "save_and_reload",
        "load_sharded",
        "resume",
        "replay",
        "train_grpo",
        "train_dpo",
    ]


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_readme_recipes_run(world, tmp_path, monkeypatch):
    chosen = [(name, code) for name, ranks, code in recipes() if ranks == world]
    module = tmp_path / f"readme_recipes_{world}.py"
    module.write_text("\n\n".join(code for _, code in chosen))
    for name, _ in chosen:
        assert f"def {name}(rank, world)" in module.read_text()
    monkeypatch.chdir(tmp_path)  # the Trainer and checkpoint recipes write under the working directory
    names = [name for name, _ in chosen]
    results = run_ranks(run_recipes, world, str(tmp_path), module.stem, names, timeout=300)
    for rank, by_name in enumerate(results):
        assert list(by_name) == names
        if "train_ddp" in by_name:
            assert by_name["train_ddp"] > 0
        if "train_deepspeed" in by_name:
            assert by_name["train_deepspeed"] > 0
        if "train_compiled" in by_name:
            assert by_name["train_compiled"] > 0
        if "generate" in by_name:
            tokens = torch.tensor(by_name["generate"])
            assert tokens.shape == (1, 4 + rank + 2 + 3 * rank)
        if "migrate_distributed_config" in by_name:
            assert by_name["migrate_distributed_config"] == 4
        if "save_and_reload" in by_name:
            assert by_name["save_and_reload"] <= 1e-5
        if "load_sharded" in by_name:
            assert by_name["load_sharded"] == 4
        if "replay" in by_name:
            assert by_name["replay"][:2] == [2, 2] and by_name["replay"][2] >= 4 + 1 + rank
        if "train_grpo" in by_name:
            assert by_name["train_grpo"] == 2
        if "train_dpo" in by_name:
            assert by_name["train_dpo"] is True  # the reference holds the policy's experts only
        if "resume" in by_name:
            assert by_name["resume"] == 1.0  # the optimizer resumed after its first step
