"""The source stays as the formatter and linter configured in pyproject.toml (``[tool.ruff]``) leave it:
``ruff check`` and ``ruff format --check`` over the package, the tests and the benchmarks. To fix:
``.venv/bin/ruff check --fix src tests benchmarks && .venv/bin/ruff format src tests benchmarks``."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["src", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *SOURCES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"ruff {' '.join(command)} (the test extras install ruff):\n{done.stdout}{done.stderr}"
