"""Every recipe of the README and of docs/ runs as written, on the ranks it says.

A recipe is a ```python block preceded by ``<!-- recipe: NAME ranks=N -->``: it defines ``NAME(rank,
world)``. The pages are read in one fixed order (:func:`pages`: README.md, then the docs/ pages in the
order of the README's documentation table, which must list every docs/*.md), and the blocks are written
to one module in that order; each function is called on every rank of a fresh process group (one spawn
per rank count). Correctness of each recipe against the same recipe without EP is checked in
tests/training/test_training.py and tests/ep/test_compose.py; links and the API reference in tests/project/test_docs.py.
"""

import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from ranks import start_ranks
from readme_recipes import run_recipes

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# env=NAME: runs in .venv-NAME (its own test); needs=LIBRARY>=X.Y: runs where that release is installed
RECIPE = re.compile(
    r"<!-- recipe: (\w+) ranks=(\d+)(?: env=(\w+))?(?: needs=([\w-]+>=[\d.]+))? -->\n```python\n(.*?)```", re.S
)
MARKER = re.compile(r"<!-- recipe:")
TABLE_ROW = re.compile(r"^\| \[docs/([\w-]+\.md)\]\(docs/\1\) \|", re.M)  # a row of the README's docs table


def pages() -> list[Path]:
    """Where recipes live, in the order they are collected: the README, then the docs/ pages in the order
    of the README's documentation table (which lists every docs/*.md once)."""
    listed = TABLE_ROW.findall((ROOT / "README.md").read_text())
    present = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert sorted(listed) == present, f"the README's documentation table lists {listed}, docs/ holds {present}"
    return [ROOT / "README.md", *(ROOT / "docs" / name for name in listed)]


def recipes():
    found = []
    for page in pages():
        text = page.read_text()
        on_page = RECIPE.findall(text)
        assert len(on_page) == len(MARKER.findall(text)), (
            f"{page.relative_to(ROOT)}: a recipe marker not followed by a ```python block"
        )
        found += [(name, int(ranks), env, needs, code) for name, ranks, env, needs, code in on_page]
    assert found, "no recipes in the README or docs/"
    return found


def met(needs: str) -> bool:
    """Whether the installed release satisfies a recipe's ``needs=`` (``""``: nothing needed)."""
    if not needs:
        return True
    requirement = Requirement(needs)
    return importlib.metadata.version(requirement.name) in requirement.specifier


def test_docs_list_the_recipes():
    """Every recipe, by page (training.md, checkpoints.md, rl.md) and in page order, each name once."""
    assert [name for name, *_ in recipes()] == [
        "train_ddp",
        "train_fsdp2",
        "train_ep_dp",
        "train_trainer",
        "train_accelerate",
        "train_deepspeed",
        "train_twinkle",
        "generate",
        "train_compiled",
        "migrate_distributed_config",
        "transformers_ep_implementation",
        "save_and_reload",
        "load_sharded",
        "resume",
        "train_replicas",
        "replay",
        "train_grpo",
        "train_dpo",
    ]
    assert {name: ranks for name, ranks, *_ in recipes()} == {
        "save_and_reload": 2,
        "load_sharded": 2,
        "resume": 2,
        "train_replicas": 2,
        "replay": 2,
        "train_grpo": 2,
        "train_dpo": 2,
        "train_ddp": 2,
        "train_fsdp2": 2,
        "train_ep_dp": 4,
        "train_trainer": 2,
        "train_accelerate": 2,
        "train_deepspeed": 2,
        "train_twinkle": 2,
        "generate": 2,
        "train_compiled": 2,
        "migrate_distributed_config": 4,
        "transformers_ep_implementation": 4,
    }


@pytest.mark.multirank
@pytest.mark.releases
@pytest.mark.parametrize("world", [2, 4])
def test_readme_recipes_run(world, tmp_path, monkeypatch):
    chosen = [(name, code) for name, ranks, env, needs, code in recipes() if ranks == world and not env and met(needs)]
    module = tmp_path / f"readme_recipes_{world}.py"
    module.write_text("\n\n".join(code for _, code in chosen))
    for name, _ in chosen:
        assert f"def {name}(rank, world)" in module.read_text()
    monkeypatch.chdir(tmp_path)  # the Trainer and checkpoint recipes write under the working directory
    names = [name for name, _ in chosen]
    results = start_ranks(run_recipes, world, str(tmp_path), module.stem, names, timeout=300)
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
        if "transformers_ep_implementation" in by_name:
            assert by_name["transformers_ep_implementation"] == 4
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


@pytest.mark.multirank
def test_the_twinkle_recipe_runs_in_twinkles_environment(tmp_path):
    """A recipe marked ``env=twinkle`` needs twinkle-kit and its own pins: written the same way, run on 2
    ranks by tests/training/twinkle_workers.py in ``.venv-twinkle`` (which applies the tests' CPU patch
    twinkle needs here) on a small Qwen3-MoE checkpoint under the recipe's default path."""
    ((name, ranks, code),) = [(name, ranks, code) for name, ranks, env, _, code in recipes() if env == "twinkle"]
    (tmp_path / "twinkle_recipe.py").write_text(code)
    python = ROOT / ".venv-twinkle" / "bin" / "python"
    assert python.exists(), "scripts/setup.sh test builds .venv-twinkle (twinkle-kit with its own pins)"
    worker = ROOT / "tests" / "training" / "twinkle_workers.py"
    proc = subprocess.run(
        [str(python), str(worker), str(tmp_path), "--recipe", "twinkle_recipe", name, "--ranks", str(ranks)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "EPMOE_START_METHOD": "spawn"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    saved = json.loads((tmp_path / "recipe.json").read_text())
    assert len(saved) == ranks and all(path.endswith("twinkle-out/lora") for path in saved), saved
    assert (tmp_path / "twinkle-out" / "lora" / "adapter_model.safetensors").exists()
