"""LLaMA-Factory's own command under ``epmoe run``, in LLaMA-Factory's own pins (docs/frameworks.md#llama-factory).

LLaMA-Factory 0.9.5 pins transformers <= 5.6.0 and peft <= 0.18.1, so it runs in ``.venv-llamafactory``
(``scripts/setup.sh test`` builds it from constraints/llamafactory.txt). Five launches of
``llamafactory-cli train`` (FORCE_TORCHRUN=1, 2 CPU ranks) on a 2-layer Qwen3-MoE of 8 experts, the
config and the command of docs/frameworks.md: full fine-tune and LoRA each without and with
``epmoe run --ep 2``, and a second EP full run resumed from the first's checkpoint-2. The saved models
are read here; reloading them with plain transformers and peft runs in the side venv
(tests/training/llamafactory_side.py). LLaMA-Factory imports torchaudio, which this machine cannot
install: the launches get the stand-in of tests/support/torchaudio_standin on their PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multirank
yaml = pytest.importorskip("yaml")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-llamafactory"
SIDE = Path(__file__).with_name("llamafactory_side.py")
STANDIN = ROOT / "tests" / "support" / "torchaudio_standin"
TIMEOUT = 600
MAX_NORM = 0.05  # the docs config's max_grad_norm: every step's norm is above it
EP_LINE = "epmoe run: Qwen3MoeForCausalLM expert-parallel, EP size 2 of 2 ranks, over the world group"


def _docs_block(kind: str, name: str) -> str:
    text = (ROOT / "docs" / "frameworks.md").read_text()
    fence = {"command": "bash", "config": "yaml"}[kind]
    found = re.search(rf"<!-- {kind}: {name} -->\n```{fence}\n(.*?)\n```", text, re.S)
    assert found, f"docs/frameworks.md: the {kind} {name} is gone"
    return found.group(1)


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EPMOE_RUN", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(VENV / "bin"), env.get("PATH", "")])  # llamafactory-cli starts `torchrun`
    # the stand-in, and this checkout's epmoe first (the venv's is editable from the checkout that built it)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT / "src")])
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**env, **offline, "HF_HOME": str(root / "hf-home"), "OMP_NUM_THREADS": "1", **extra}


def _side(command: str, root: Path) -> None:
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(SIDE), command, str(root)],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"llamafactory_side.py {command}:\n{done.stdout[-3000:]}{done.stderr[-6000:]}"


def _launch(words: list[str], config: dict, root: Path) -> str:
    """Runs ``words`` (the docs command, ``VAR=value`` words first) with ``cfg.yaml`` written from ``config``;
    its output (stdout and stderr)."""
    path = root / f"{config['output_dir']}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(word.split("=", 1) for word in words if re.match(r"[A-Z_]+=", word))
    argv = [str(path) if w == "cfg.yaml" else w for w in words if not re.match(r"[A-Z_]+=", w)]
    if argv[0] == "epmoe":
        argv[0] = str(VENV / "bin" / "epmoe")
    done = subprocess.run(
        argv,
        cwd=root,
        env=_env(root, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )
    (root / f"{config['output_dir']}.log").write_text(done.stdout)
    # a known, unexplained abort of the resumed EP launch at process exit, after training and every save
    # (a rank's SIGABRT, "terminate called without an active exception", after LLaMA-Factory's
    # destroy_process_group; seen a few times in ~100 launches on a loaded machine): its outputs are
    # still checked in full by the tests below, which fail where anything is missing
    aborted_at_exit = (
        "terminate called without an active exception" in done.stdout
        and (root / config["output_dir"] / "model.safetensors").exists()
    )
    assert done.returncode == 0 or aborted_at_exit, f"{argv}:\n{done.stdout[-10000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(root, {run: output})``: plain-full, ep-full, ep-full-resumed, plain-lora, ep-lora under root."""
    assert (VENV / "bin" / "llamafactory-cli").exists(), "scripts/setup.sh test builds .venv-llamafactory"
    root = tmp_path_factory.mktemp("llamafactory")
    _side("build", root)
    ep_words = _docs_command()
    cut = ep_words.index("epmoe")
    plain_words = ep_words[:cut] + ep_words[ep_words.index("--") + 1 :]
    assert plain_words[-3:] == ["llamafactory-cli", "train", "cfg.yaml"], plain_words
    base = yaml.safe_load(_docs_block("config", "llamafactory"))
    base["disable_tqdm"] = True
    lora = {**base, "finetuning_type": "lora", "lora_target": "all"}
    # seen 3 times in about 60 launches, never since the logs are kept (root/<run>.log): this launch's rank
    # aborting at exit ("terminate called without an active exception") after its saves, on a loaded machine
    resumed = {**base, "resume_from_checkpoint": "ep-full/checkpoint-2"}
    output = {}
    for name, words, config in [
        ("plain-full", plain_words, base),
        ("ep-full", ep_words, base),
        ("ep-full-resumed", ep_words, resumed),
        ("plain-lora", plain_words, lora),
        ("ep-lora", ep_words, lora),
    ]:
        output[name] = _launch(words, {**config, "output_dir": name}, root)
    _side("reload", root)
    return root, output


def _docs_command() -> list[str]:
    return _docs_block("command", "llamafactory").split()


def _steps(out: Path) -> list[dict]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "loss" in entry]


def test_the_environment_has_llamafactorys_own_pins(runs):
    versions = json.loads((runs[0] / "versions.json").read_text())
    assert versions["llamafactory"] == "0.9.5" and versions["transformers"] == "5.6.0", versions
    assert versions["peft"] == "0.18.1" and versions["trl"] == "0.24.0" and versions["accelerate"] == "1.11.0"
    assert versions["torchaudio"] == "stand-in" and versions["torchvision"] is None, versions


def test_each_ep_launch_made_the_model_expert_parallel_once(runs):
    for name, output in runs[1].items():
        lines = [line for line in output.splitlines() if line.startswith("epmoe run:")]
        assert lines == ([EP_LINE] if name.startswith("ep-") else []), (name, lines)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_losses_and_grad_norms_equal_the_plain_run(runs, kind):
    plain, ep = _steps(runs[0] / f"plain-{kind}"), _steps(runs[0] / f"ep-{kind}")
    assert [s["step"] for s in ep] == [s["step"] for s in plain] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([s[key] for s in ep]), torch.tensor([s[key] for s in plain]), rtol=1e-5, atol=0
        )
    assert all(s["grad_norm"] > MAX_NORM for s in plain)  # every step clipped


@pytest.mark.parametrize("where", ["", "checkpoint-2"])
def test_saved_model_is_the_unsharded_one(runs, where):
    root = runs[0]
    original = safetensors_torch.load_file(root / "model-dir" / "model.safetensors")
    plain = safetensors_torch.load_file(root / "plain-full" / where / "model.safetensors")
    saved = safetensors_torch.load_file(root / "ep-full" / where / "model.safetensors")
    shapes = {k: v.shape for k, v in original.items()}
    assert {k: v.shape for k, v in saved.items()} == shapes == {k: v.shape for k, v in plain.items()}
    experts = [k for k in saved if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3  # 2 layers, 8 experts, 3 projections: every expert, whole
    assert {re.sub(r"\.experts\.\d+\.", ".experts.E.", k) for k in experts} == {
        f"model.layers.{layer}.mlp.experts.E.{proj}.weight"
        for layer in (0, 1)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    # AdamW divides by sqrt(v) + eps: where a clipped gradient is near eps, its float32 rounding moves that
    # element's step (at most lr = 1e-3) by more than the rounding itself: a few 1e-6 seen
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert any(not torch.equal(saved[k], original[k]) for k in experts)  # the experts trained


def test_adapter_is_the_plain_runs(runs):
    plain = safetensors_torch.load_file(runs[0] / "plain-lora" / "adapter_model.safetensors")
    saved = safetensors_torch.load_file(runs[0] / "ep-lora" / "adapter_model.safetensors")
    assert saved.keys() == plain.keys()
    # lora_target: all -> LLaMA-Factory's nn.Linear modules: the attention projections of both layers
    assert {k.split(".")[-3] for k in saved} == {"q_proj", "k_proj", "v_proj", "o_proj"} and len(saved) == 2 * 4 * 2
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_plain_transformers_and_peft_reload_them(runs):
    """In LLaMA-Factory's environment, no epmoe: the full model loads with no key missing or unexpected,
    the adapter onto the base model; their logits are the run without EP's, and differ from the base's."""
    reload = json.loads((runs[0] / "reload.json").read_text())
    for run in ("plain", "ep"):
        loading = reload[f"{run}-full loading"]
        assert loading["missing_keys"] == loading["unexpected_keys"] == loading["mismatched_keys"] == [], loading
    for kind in ("full", "lora"):
        assert reload[kind]["ep_vs_plain"] <= 1e-5 and reload[kind]["trained_vs_base"] > 1e-3, (kind, reload)


def test_a_resumed_ep_run_continues_as_the_uninterrupted_one(runs):
    """The second EP launch resumes the first's checkpoint-2 (the model and optimizer from its
    epmoe_dcp/): steps 3 and 4 and the saved model equal the uninterrupted run's."""
    root = runs[0]
    assert (root / "ep-full" / "checkpoint-2" / "epmoe_dcp" / ".metadata").exists()
    assert "Resuming training from checkpoint" in runs[1]["ep-full-resumed"]
    resumed, whole = _steps(root / "ep-full-resumed"), _steps(root / "ep-full")
    assert [s["step"] for s in resumed] == [1, 2, 3, 4]  # steps 1 and 2: the checkpoint's log history
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([s[key] for s in resumed[2:]]), torch.tensor([s[key] for s in whole[2:]]), rtol=1e-5, atol=0
        )
    assert len((root / "ep-full-resumed" / "trainer_log.jsonl").read_text().splitlines()) == 3  # 3, 4, the end
    saved = safetensors_torch.load_file(root / "ep-full-resumed" / "model.safetensors")
    for key, value in safetensors_torch.load_file(root / "ep-full" / "model.safetensors").items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-7, msg=key)
