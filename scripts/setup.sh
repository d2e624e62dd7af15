#!/usr/bin/env bash
# Set up ./.venv for epmoe: `scripts/setup.sh` (demo extras) or `scripts/setup.sh test` (test extras).
#
# A torch that python3 can already import is kept (the venv sees system site-packages). Otherwise
# torch is installed as $EPMOE_TORCH (default torch==2.13.0: a CPU build from local disk on the
# project's CI machines; set EPMOE_TORCH=torch on a GPU machine to take PyPI's CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-demo}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    "$python" -m venv --system-site-packages .venv
  else
    "$python" -m venv .venv
  fi
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "${EPMOE_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" -e ".[$extras]"
