"""``benchmarks/data_path.py``: the functions of epmoe one forward + backward of the small Qwen3-MoE at
EP 2 passes through, at the steady (second) step; the first step, which also runs what is decided
once, is reported beside it. The measure runs, sees the layer's path, and the path stays within the
bound it was brought to (103 functions in 18 files before the dispatcher took one shape, 93 in 19
before the per-call decisions moved off it, 85 in 18 before what is decided once was kept instead of
derived again each step; 57 to 59, 16 to 18 in the dispatch, when each row's route came to travel
inside it, one collective fewer each way; 59 to 69 and 15 to 18 files when the layer came to run the
protocol itself, its transports only moving tokens, the counts exchange, the step positions and the
load counters each in a module of its own; 69 to 70, 22 to 23 in the dispatch, when the route
dtype's rule, which every path of both exchanges follows, came to be written once: ep/routing.py's
route_dtype), none of its functions longer than 60 lines; one layer call enters at most 18 files
(what a reader of the layer opens, forward and backward: 17 to 18 when LocalExperts split into its
weights, ep/expert_weights.py, and its compute, ep/experts.py, with 69 functions still); and what
the steady path no longer looks at each step is still seen when it changes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTIONS = 70  # the whole path (the steady step)
MAX_DISPATCH_FUNCTIONS = 23  # of which the layer, its dispatcher and the routing indices
MAX_LAYER_FILES = 18  # the files one layer call enters, forward and backward
DISPATCH_FILES = ("ep/layer.py", "ep/routing.py", "ep/dispatch/")


@pytest.mark.multirank
def test_data_path_stays_within_its_bound():
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_path.py"), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    functions = [tuple(f) for f in result["functions"]]
    names = {(file, name) for file, name, _, _ in functions}
    for step in [
        ("ep/layer.py", "routed_experts"),
        ("ep/counts.py", "exchange_layer_counts"),
        ("ep/dispatch/alltoallv.py", "AllToAllVDispatcher.dispatch"),
        ("ep/dispatch/alltoallv.py", "AllToAllVDispatcher.combine"),
        ("ep/mlp.py", "_routed_mlp_backward_op"),
    ]:
        assert step in names, f"the measure missed {step}: it no longer sees the forward and backward"
    assert result["files"] == sorted({file for file, _, _, _ in functions})
    assert result["first_step"]["functions"] >= len(functions), result["first_step"]
    assert len(functions) <= MAX_FUNCTIONS, "\n".join(f"{file} {name}" for file, name, _, _ in functions)
    dispatch = [f"{file} {name}" for file, name, _, _ in functions if file.startswith(DISPATCH_FILES)]
    assert len(dispatch) <= MAX_DISPATCH_FUNCTIONS, "\n".join(dispatch)
    assert result["over"] == [], result["over"]
    layer = result["layer_files"]
    assert "ep/layer.py" in layer["forward"] and "ep/mlp.py" in layer["backward"], layer
    assert layer["call"] == len(set(layer["forward"]) | set(layer["backward"])) <= MAX_LAYER_FILES, layer


class DeepSpeedEngine:
    """Stands in for a DeepSpeed engine: a forward pre-hook whose qualified name is the engine's."""

    def hook(self, module, args):
        return None


def _shortcut_cases(rank: int, world: int) -> dict:
    """Two steady steps, then what the per-forward look and leaf checks must still see although the
    steady path skips them while nothing they read changed: an expert parameter marked by another
    model is marked as this model's again, and a DeepSpeed engine's hook appearing on the root is
    refused at the next forward."""
    import epmoe
    from epmoe.ep.model import expert_owner
    from epmoe.ep.state import ep_model
    from epmoe.models import build_model

    torch.manual_seed(0)
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
    owner, param = ep_model(model), epmoe.expert_parameters(model)[0]
    param._epmoe_expert = object()  # another model's mark
    model(ids, labels=ids).loss.backward()
    remarked = expert_owner(param) is owner
    model.register_forward_pre_hook(DeepSpeedEngine().hook)
    try:
        model(ids, labels=ids).loss.backward()
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"remarked": remarked, "refused": refused}


@pytest.mark.multirank
def test_the_steady_path_still_sees_what_changed():
    pytest.importorskip("transformers")
    from ranks import start_ranks

    for result in start_ranks(_shortcut_cases, 2, timeout=300):
        assert result["remarked"], result
        assert "epmoe.prepare_deepspeed(model)" in result["refused"], result
