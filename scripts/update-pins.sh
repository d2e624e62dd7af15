#!/usr/bin/env bash
# Move constraints/test.txt to the newest releases and show what changed: `scripts/update-pins.sh`.
#
# Installs -e ".[test]" WITHOUT constraints into a fresh temporary venv (torch as scripts/setup.sh
# does it: a torch >= 2.9 that python3 can import is kept, otherwise $EPMOE_TORCH, default
# torch==2.13.0), rewrites constraints/test.txt from it (every installed package of epmoe[test]'s
# dependency tree except torch, pip/setuptools/wheel and CUDA/triton wheels), prints the changed
# pins, then runs tests/models/families_table.py with the new versions (every MoE family at EP 2 on 2
# local ranks: a few minutes) and diffs its table against docs/models.md's.
# Then: `rm -rf .venv && scripts/setup.sh test && .venv/bin/python -m pytest -q`, and commit.
set -euo pipefail

header='# Exact versions of every package `pip install -e ".[test]"` installs besides torch and epmoe
# (the demo extras are a subset). scripts/setup.sh installs with `-c constraints/test.txt`; torch
# itself comes from scripts/setup.sh (torch==2.13.0 unless a system torch >= 2.9 is kept).
# Generated, do not edit: `scripts/update-pins.sh` regenerates it from the newest releases.'

# pins PYTHON: the constraints file (header, then name==version by name) for the epmoe[test]
# installed in PYTHON's environment: its dependency tree as installed, like `pip freeze` but without
# packages that nothing in the tree needs (a --system-site-packages venv sees the system's too).
pins() {
  printf '%s\n' "$header"
  "$1" - <<'PY'
import re
from importlib.metadata import distribution

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


done, dists, todo = {}, {}, [("epmoe", {"test"})]
while todo:
    name, extras = todo.pop()
    dist = distribution(name)
    key = canon(dist.metadata["Name"])
    dists[key] = dist
    new = ({""} | extras) - done.setdefault(key, set())
    done[key] |= new
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in new):
            todo.append((req.name, set(req.extras)))
skip = re.compile(r"(epmoe|torch|pip|setuptools|wheel|distribute|triton|pytorch-triton.*|nvidia-.*|cuda-.*)")
for key in sorted(k for k in dists if not skip.fullmatch(k)):
    print(f"{dists[key].metadata['Name']}=={dists[key].version}")
PY
}

# changes OLD NEW: one line per pin that differs, "name: old -> new".
changes() {
  awk -F'==' '
    /^#/ || NF != 2 { next }
    FNR == NR { old[tolower($1)] = $2; next }
    { new[tolower($1)] = $2; name[tolower($1)] = $1 }
    END {
      for (k in new) if (!(k in old)) print "  " name[k] ": (new) -> " new[k]
                     else if (old[k] != new[k]) print "  " name[k] ": " old[k] " -> " new[k]
      for (k in old) if (!(k in new)) print "  " k ": " old[k] " -> (gone)"
    }' "$1" "$2" | sort
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local python=${PYTHON:-python3} py
  local has_torch='import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 9))'
  tmp=$(mktemp -d) # global: the EXIT trap runs after main has returned
  trap 'rm -rf "$tmp"' EXIT
  if "$python" -c "$has_torch" 2>/dev/null; then
    "$python" -m venv --system-site-packages "$tmp/venv"
  else
    "$python" -m venv "$tmp/venv"
  fi
  py=$tmp/venv/bin/python
  local pip=("$py" -m pip install -q --disable-pip-version-check)
  if ! "$py" -c "$has_torch" 2>/dev/null; then
    "${pip[@]}" "${EPMOE_TORCH:-torch==2.13.0}"
  fi
  # The newest releases, torch kept as it is; eager so that packages the system site already has move too.
  "$py" -W ignore -c 'import torch; print("torch==" + torch.__version__)' >"$tmp/torch.txt"
  echo "Installing -e \".[test]\" at the newest releases into $tmp/venv ..."
  "${pip[@]}" --upgrade --upgrade-strategy eager -c "$tmp/torch.txt" -e ".[test]"
  "$py" -m pip check

  if [ -f constraints/test.txt ]; then cp constraints/test.txt "$tmp/old.txt"; else : >"$tmp/old.txt"; fi
  mkdir -p constraints
  pins "$py" >"$tmp/new.txt"
  cp "$tmp/new.txt" constraints/test.txt
  echo
  git --no-pager diff --stat -- constraints/test.txt
  echo "Changed pins (constraints/test.txt):"
  changes "$tmp/old.txt" constraints/test.txt | grep . || echo "  none"

  echo
  echo "MoE families with the new pins: tests/models/families_table.py runs every family at EP 2 on 2"
  echo "local gloo ranks; this takes a few minutes ..."
  PYTHONPATH=src:tests/support "$py" tests/models/families_table.py | grep '^|' >"$tmp/families.new"
  PYTHONPATH=src:tests/support:tests/models "$py" -c 'import families_table as f
print(f.table(f.table_verdicts(f.PAGE.read_text())))' >"$tmp/families.old"
  if diff -u --label "docs/models.md's families table" --label "with the new pins" "$tmp/families.old" "$tmp/families.new"; then
    echo "Families table: unchanged."
  else
    echo "Families table changed: \`PYTHONPATH=src:tests/support .venv/bin/python tests/models/families_table.py --write\` rewrites docs/models.md's (after scripts/setup.sh test with the new pins)."
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
