#!/usr/bin/env bash
# Set up ./.venv for epmoe: `scripts/setup.sh` (demo extras) or `scripts/setup.sh test` (test extras, and
# ./.venv-twinkle: twinkle-kit with its own pins, for tests/training/test_twinkle.py).
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
if [ "$extras" = test ]; then
  # twinkle-kit pins peft <= 0.19, below the test extras' peft: tests/training/test_twinkle.py runs it
  # in a venv of its own pins (constraints/twinkle.txt), with the same torch
  if [ ! -x .venv-twinkle/bin/python ]; then
    if "$python" -c "$has_torch" 2>/dev/null; then
      "$python" -m venv --system-site-packages .venv-twinkle
    else
      "$python" -m venv .venv-twinkle
    fi
  fi
  twinkle_pip=(.venv-twinkle/bin/python -m pip install -q --disable-pip-version-check)
  if ! .venv-twinkle/bin/python -c "$has_torch" 2>/dev/null; then
    "${twinkle_pip[@]}" -c constraints/twinkle.txt "${EPMOE_TORCH:-torch==2.13.0}"
  fi
  "${twinkle_pip[@]}" -c constraints/twinkle.txt -e ".[twinkle]"
fi
