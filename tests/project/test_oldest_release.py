"""The suite's release-bound part under the oldest transformers epmoe serves, in its own environment.

``.venv-oldest`` (``scripts/setup.sh test`` builds it from constraints/oldest.txt: transformers 5.6.0 with
the peft 0.18.1 and trl 0.24.0 LLaMA-Factory 0.9.5 pins beside it, the same torch, epmoe editable) runs,
in one pytest there, the fast tier and the multi-rank tests marked ``releases`` (every MoE family that
release ships at EP 2, LoRA on their experts, the recipes of the docs, complete saves, the state-dict
warnings; ``epmoe run`` runs under 5.19 in tests/training/test_swift.py). Test modules about what that release lacks are left out, each with the probe that shows it
lacks it: when the oldest release moves up to one that has it, the probe fails here and the module
joins the run."""

import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.multirank

ROOT = pathlib.Path(__file__).resolve().parents[2]
OLDEST_PYTHON = ROOT / ".venv-oldest" / "bin" / "python"

# test module -> (a probe that is true where the oldest release lacks what the module tests, what it lacks)
NEWER = {
    "tests/models/test_transformers_ep.py": (
        "import importlib.util; print(importlib.util.find_spec('transformers.distributed.expert_parallel') is None)",
        "transformers' own expert parallelism and its implementations registry (5.22 on; DistributedConfig(ep_size, "
        "fsdp_size, ep_implementation) 5.24 on)",
    ),
    "tests/models/test_experts_implementation.py": (
        "import inspect; from transformers import PreTrainedModel; "
        "print('ALL_EXPERTS_FUNCTIONS' not in inspect.getsource(PreTrainedModel.get_correct_experts_implementation))",
        'experts_implementation="epmoe": transformers looks the name up in its experts registry from 5.7 on (5.6 '
        "accepts only its own four names)",
    ),
    "tests/models/test_experts_inside.py": (
        "import inspect; from transformers.integrations import use_experts_implementation; "
        "print('has_post_expert_norm' not in inspect.signature(use_experts_implementation).parameters)",
        "experts modules holding a norm after the down projection (use_experts_implementation(has_post_expert_norm), "
        "5.20 on) and the families that have them",
    ),
}


def _oldest(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "EPMOE_START_METHOD": "spawn"}
    return subprocess.run(
        [str(OLDEST_PYTHON), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_the_modules_left_out_test_what_the_oldest_release_lacks():
    assert OLDEST_PYTHON.exists(), "scripts/setup.sh test builds .venv-oldest (constraints/oldest.txt)"
    for module, (probe, lacks) in NEWER.items():
        proc = _oldest("-c", probe, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "True", (module, lacks, proc.stdout, proc.stderr[-2000:])


@pytest.mark.timeout(1500)
def test_the_release_bound_part_of_the_suite_passes_under_the_oldest_release():
    assert OLDEST_PYTHON.exists(), "scripts/setup.sh test builds .venv-oldest (constraints/oldest.txt)"
    left_out = [f"--ignore={module}" for module in NEWER]
    proc = _oldest(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not multirank or releases", *left_out, timeout=1400
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"under .venv-oldest: {summary}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
