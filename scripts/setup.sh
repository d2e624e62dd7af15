#!/usr/bin/env bash
# Set up ./.venv for epmoe: `scripts/setup.sh` (demo extras) or `scripts/setup.sh test` (test extras, and
# two venvs of their own pins: ./.venv-twinkle, twinkle-kit's, for tests/training/test_twinkle.py, and
# ./.venv-oldest, the oldest transformers epmoe serves, for tests/project/test_oldest_release.py).
#
# Needs Python 3.10+. A torch >= 2.9 that python3 can already import is kept (the venv sees system
# site-packages). Otherwise torch is installed as $EPMOE_TORCH (default torch==2.13.0: a CPU build
# from local disk on the project's CI machines; set EPMOE_TORCH=torch on a GPU machine to take
# PyPI's CUDA build). Everything else is installed at the exact versions of constraints/test.txt
# (`pip install -c`; scripts/update-pins.sh moves them to the newest releases).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-demo}
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "epmoe needs Python 3.10 or newer; $python is $("$python" --version 2>&1)" >&2
  exit 1
fi
has_torch='import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 9))'
if [ ! -x .venv/bin/python ]; then
  if "$python" -c "$has_torch" 2>/dev/null; then
    "$python" -m venv --system-site-packages .venv
  else
    "$python" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "$has_torch" 2>/dev/null; then
  "${pip[@]}" -c constraints/test.txt "${EPMOE_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" -c constraints/test.txt -e ".[$extras]"
# side_venv DIR CONSTRAINTS EXTRAS: a venv of its own pins beside .venv, with the same torch and epmoe editable
side_venv() {
  if [ ! -x "$1/bin/python" ]; then
    if "$python" -c "$has_torch" 2>/dev/null; then
      "$python" -m venv --system-site-packages "$1"
    else
      "$python" -m venv "$1"
    fi
  fi
  local side_pip=("$1/bin/python" -m pip install -q --disable-pip-version-check)
  if ! "$1/bin/python" -c "$has_torch" 2>/dev/null; then
    "${side_pip[@]}" -c "$2" "${EPMOE_TORCH:-torch==2.13.0}"
  fi
  "${side_pip[@]}" -c "$2" -e ".[$3]"
}
# llamafactory_venv DIR CONSTRAINTS: side_venv with the models extra, and LLaMA-Factory. It requires torchvision
# and torchaudio, whose wheels need another torch than the CPU one here: it goes in without its dependencies, then
# each of its other requirements at CONSTRAINTS' pins (pip then names the two as missing;
# tests/training/test_llamafactory.py stands in for torchaudio, which LLaMA-Factory imports for audio inputs only)
llamafactory_venv() {
  side_venv "$1" "$2" models
  local side_pip=("$1/bin/python" -m pip install -q --disable-pip-version-check -c "$2")
  "${side_pip[@]}" --no-deps llamafactory
  local requirements
  mapfile -t requirements < <("$1/bin/python" -c 'import importlib.metadata as m, re
for r in m.requires("llamafactory"):
    if ";" not in r and re.match(r"[\w.-]+", r)[0] not in ("torchaudio", "torchvision"): print(r)')
  "${side_pip[@]}" "${requirements[@]}"
}
if [ "$extras" = test ]; then
  # twinkle-kit pins peft <= 0.19, below the test extras' peft: tests/training/test_twinkle.py runs it
  # in a venv of its own pins (constraints/twinkle.txt)
  side_venv .venv-twinkle constraints/twinkle.txt twinkle
  # the oldest transformers epmoe serves (5.6.0, LLaMA-Factory's pin, with its peft and trl):
  # tests/project/test_oldest_release.py runs the suite's release-bound part there
  side_venv .venv-oldest constraints/oldest.txt test
  # ms-swift 4.6.0 pins transformers < 5.20 and peft < 0.21: tests/training/test_swift.py launches its `swift sft`
  # there, with and without `epmoe run` (constraints/swift.txt)
  side_venv .venv-swift constraints/swift.txt swift
  # LLaMA-Factory 0.9.5 pins transformers <= 5.6.0 and peft <= 0.18.1: tests/training/test_llamafactory.py runs
  # its CLI in a venv of its own pins (constraints/llamafactory.txt)
  llamafactory_venv .venv-llamafactory constraints/llamafactory.txt
  # axolotl 0.19.0 resolves to transformers 5.16.1, peft 0.20.0 and trl 1.9.0: tests/training/test_axolotl.py launches
  # its `axolotl train` there, with and without `epmoe run` (constraints/axolotl.txt)
  side_venv .venv-axolotl constraints/axolotl.txt axolotl
fi
