"""``epmoe run -- axolotl train``: axolotl's own CLI, at its own pins, with and without ``epmoe run``.

axolotl 0.19.0 resolves to transformers 5.16.1, peft 0.20.0, trl 1.9.0 and accelerate 1.13.0, so its
commands run in ``.venv-axolotl`` (``scripts/setup.sh test`` builds it from constraints/axolotl.txt, the
same torch, epmoe editable). The command and the configs are docs/frameworks.md's (``axolotl_train``,
``axolotl_full``, ``axolotl_lora``), the command launched as written (``--launcher torchrun --
--nproc_per_node 2``: 2 gloo ranks) and again without ``epmoe run --ep 2 --`` (every rank all experts,
DDP), the configs with the test's keys for a tiny float32 run on CPUs (:data:`TINY`). Five launches, once
per module: the full fine-tune and the LoRA one (attention targets) with and without EP, and the EP full
fine-tune resumed from its own ``checkpoint-2``. Compared here: each step's loss and clipped grad norm
(the last checkpoint's ``trainer_state.json``), the saved models (every expert whole, as the plain run's,
reloaded by plain ``from_pretrained``), the adapter (reloaded by plain peft) and the resumed steps.

The model, tokenizer and data are test_swift's (:func:`test_swift._save_inputs`); nothing is downloaded
(the hub's offline flags) and axolotl's telemetry is off (``AXOLOTL_DO_NOT_TRACK``: it retries at exit).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test_swift import _docs_command, _free_port, _save_inputs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")
yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
AXOLOTL_BIN = ROOT / ".venv-axolotl" / "bin"
TIMEOUT = 400
STEPS = 4
ATOL = 1e-5  # as test_swift's: an Adam step of lr 1e-3 moves float32 rounding of a near-zero gradient ~1e-6
# The test's keys beside the documented config: a tiny float32 run on CPUs (the plugin: axolotl 0.19 has
# no CPU setting for several ranks), every step logged and clipped (max_grad_norm below each step's
# norm), a checkpoint every 2 steps, one data order.
TINY = {
    "sequence_len": 64,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "max_steps": STEPS,
    "learning_rate": 1e-3,
    "optimizer": "adamw_torch",
    "lr_scheduler": "constant",
    "bf16": False,
    "fp16": False,
    "tf32": False,
    "logging_steps": 1,
    "save_steps": 2,
    "max_grad_norm": 0.05,
    "seed": 0,
    "plugins": ["axolotl_cpu_ranks.CpuRanks"],
}


def _docs_config(name: str) -> dict:
    text = (ROOT / "docs" / "frameworks.md").read_text()
    found = re.search(rf"<!-- config: {name} -->\n```yaml\n(.*?)\n```", text, re.S)
    assert found, f"docs/frameworks.md: the config {name} is gone"
    return yaml.safe_load(found.group(1))


def _launch(words: list[str], root: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "EPMOE_RUN"}
    environ.update(
        PATH=os.pathsep.join([str(AXOLOTL_BIN), environ.get("PATH", "")]),  # axolotl, torchrun, their python
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "src"), str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),  # epmoe, the plugin
        MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=_free_port(),  # torchrun's --master-port
        OMP_NUM_THREADS="1",
        AXOLOTL_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf-home"),
    )
    if words[:2] == ["epmoe", "run"]:
        words = [str(AXOLOTL_BIN / "python"), "-m", "epmoe.cli", *words[1:]]
    return subprocess.run(words, cwd=root, env=environ, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (out_dir, output)}`` of the five launches."""
    assert (AXOLOTL_BIN / "axolotl").exists(), "scripts/setup.sh test builds .venv-axolotl (axolotl's own pins)"
    root = tmp_path_factory.mktemp("axolotl")
    model_dir, data = _save_inputs(root)
    env, words = _docs_command("axolotl_train")
    assert env == {} and words[:5] == ["epmoe", "run", "--ep", "2", "--"] and words[7] == "cfg.yml", words
    full, lora = _docs_config("axolotl_full"), _docs_config("axolotl_lora")
    assert full["base_model"] == "model-dir" and full["datasets"][0]["path"] == "data.jsonl"
    results = {}
    for name in ("full_plain", "full_ep", "full_resume", "lora_plain", "lora_ep"):
        config = {**full, **(lora if name.startswith("lora") else {}), **TINY}
        config.update(base_model=str(model_dir), output_dir=str(root / name))
        config.update(datasets=[{**full["datasets"][0], "path": str(data)}])
        config.update(dataset_prepared_path=str(root / "prepared"))
        if name == "full_resume":
            config.update(resume_from_checkpoint=str(root / "full_ep" / "checkpoint-2"))
        (root / f"{name}.yml").write_text(yaml.safe_dump(config))
        command = [f"{name}.yml" if w == "cfg.yml" else w for w in words]
        done = _launch(command if name.endswith(("_ep", "_resume")) else command[5:], root)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{name}: {command}\n{output[-8000:]}"
        results[name] = (root / name, output)
    return results


def _steps(out: Path) -> list[dict]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [row for row in state["log_history"] if "loss" in row]


def _close(run: list[dict], plain: list[dict], key: str) -> None:
    torch.testing.assert_close(
        torch.tensor([s[key] for s in run], dtype=torch.float64),
        torch.tensor([s[key] for s in plain], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


def test_the_environment_has_axolotls_own_pins():
    code = (
        "import importlib.metadata as m; "
        "print(*(m.version(p) for p in ('axolotl', 'transformers', 'peft', 'trl', 'accelerate', 'torch')))"
    )
    done = subprocess.run([str(AXOLOTL_BIN / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    axolotl, transformers_, peft_, trl, accelerate, torch_ = done.stdout.split()
    assert (axolotl, transformers_, peft_, trl, accelerate) == ("0.19.0", "5.16.1", "0.20.0", "1.9.0", "1.13.0")
    assert torch_.startswith("2.13.0")


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_losses_and_clipped_grad_norms_equal_the_plain_run(runs, kind):
    plain, ep = _steps(runs[f"{kind}_plain"][0]), _steps(runs[f"{kind}_ep"][0])
    assert [s["step"] for s in ep] == [s["step"] for s in plain] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        _close(ep, plain, key)
    assert all(step["grad_norm"] > 0.05 for step in plain)  # max_grad_norm 0.05: every step clipped


def test_one_line_per_model_made_expert_parallel(runs):
    for name in ("full_ep", "lora_ep", "full_resume"):
        lines = [line for line in runs[name][1].splitlines() if line.startswith("epmoe run:")]
        assert lines == ["epmoe run: Qwen3MoeForCausalLM expert-parallel, EP size 2 of 2 ranks, over the world group"]
    assert "epmoe run:" not in runs["full_plain"][1] + runs["lora_plain"][1]


def test_the_saved_models_hold_every_expert_whole_and_reload_in_plain_transformers(runs):
    """``checkpoint-2``, ``checkpoint-4`` (Trainer's saves) and the output directory (axolotl's final save,
    local rank 0's ``model.save_pretrained``, joined by the other ranks under ``epmoe run``)."""
    original = safetensors_torch.load_file(runs["full_plain"][0].parent / "model-dir" / "model.safetensors")
    for sub in ("checkpoint-2", f"checkpoint-{STEPS}", "."):
        plain = safetensors_torch.load_file(runs["full_plain"][0] / sub / "model.safetensors")
        saved = safetensors_torch.load_file(runs["full_ep"][0] / sub / "model.safetensors")
        shapes = {k: v.shape for k, v in original.items()}
        assert {k: v.shape for k, v in saved.items()} == shapes == {k: v.shape for k, v in plain.items()}, sub
        assert sum(".mlp.experts." in k for k in saved) == 2 * 3 * 8  # 2 layers x 3 projections x 8 experts
        for key, value in plain.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=ATOL, msg=f"{sub}: {key}")
        assert any(not torch.equal(saved[k], original[k]) for k in saved if ".mlp.experts." in k)  # trained
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["full_ep"][0])
    reloaded = dict(model.state_dict())
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(runs["full_plain"][0])
    for key, value in unsharded.state_dict().items():
        torch.testing.assert_close(reloaded[key], value, rtol=1e-5, atol=ATOL, msg=key)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8))).logits).all()


def test_the_lora_adapter_reloads_with_plain_peft_on_the_base_model(runs):
    out = runs["lora_ep"][0]
    saved = safetensors_torch.load_file(out / "adapter_model.safetensors")
    plain = safetensors_torch.load_file(runs["lora_plain"][0] / "adapter_model.safetensors")
    assert sorted(saved) == sorted(plain) and len(saved) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert all(re.search(r"\.(q_proj|v_proj)\.lora_[AB]\.weight$", k) for k in saved), sorted(saved)
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=ATOL, msg=key)
    assert any(k.endswith("lora_B.weight") and saved[k].abs().max() > 0 for k in saved)  # trained from zero
    base = transformers.AutoModelForCausalLM.from_pretrained(out.parent / "model-dir")
    model = peft.PeftModel.from_pretrained(base, out)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    for key, value in saved.items():
        (match,) = [v for k, v in loaded.items() if k.replace(".default", "") == key]
        torch.testing.assert_close(match, value, rtol=0, atol=0, msg=key)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8))).logits).all()


def test_a_resumed_run_continues_as_the_uninterrupted_one(runs):
    """``resume_from_checkpoint`` of the EP run's ``checkpoint-2`` (its ``epmoe_dcp/``: the model and the
    optimizer's moments, every expert's), under ``epmoe run`` again: steps 3 and 4 as the run that went
    on, and the same final model."""
    ep, resumed = _steps(runs["full_ep"][0]), _steps(runs["full_resume"][0])
    assert [s["step"] for s in resumed] == list(range(1, STEPS + 1))  # steps 1, 2 from checkpoint-2's state
    for key in ("loss", "grad_norm"):
        _close(resumed, ep, key)
    assert (runs["full_ep"][0] / "checkpoint-2" / "epmoe_dcp").is_dir()
    final = safetensors_torch.load_file(runs["full_ep"][0] / "model.safetensors")
    again = safetensors_torch.load_file(runs["full_resume"][0] / "model.safetensors")
    assert sorted(again) == sorted(final)
    for key, value in final.items():
        torch.testing.assert_close(again[key], value, rtol=1e-5, atol=ATOL, msg=key)
