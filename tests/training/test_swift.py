"""``epmoe run -- swift sft``: ms-swift's own CLI, at its own pins, with and without ``epmoe run``.

ms-swift 4.6.0 pins transformers < 5.20 and peft < 0.21, so its commands run in ``.venv-swift``
(``scripts/setup.sh test`` builds it from constraints/swift.txt: transformers 5.19.0, peft 0.20.0,
trl 0.29.1, the same torch, epmoe editable). The commands are docs/frameworks.md's (``swift_full``,
``swift_lora``), each launched as written (``NPROC_PER_NODE=2``: swift re-launches itself under
torchrun, 2 gloo ranks) and again without ``epmoe run --ep 2 --`` (every rank all experts, DDP), with
the test's flags for a tiny float32 run on CPUs appended (:data:`TINY`). Five launches, once per module:
the full fine-tune and the LoRA one (attention targets) with and without EP, and the EP full fine-tune
resumed from its own ``checkpoint-2`` (and a sixth, LoRA on the experts, refused). Compared here, in this environment's transformers and peft: each
step's loss and clipped grad norm (``logging.jsonl``, rank 0's), the saved model (every expert whole, as
the plain run's, reloaded by plain ``from_pretrained``), the adapter (reloaded by plain peft on the base
model) and the resumed steps.

The model is a 2-layer Qwen3-MoE of 8 experts (``epmoe.models.build_model``), the tokenizer a byte-level
BPE built with ``tokenizers`` and saved as a ``PreTrainedTokenizerFast``, the data 36 chat rows in a
local JSONL file; nothing is downloaded (``USE_HF=1`` and the hub's offline flags, ``--check_model
false``: swift would otherwise ask ModelScope whether the local model is the latest).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[2]
SWIFT_BIN = ROOT / ".venv-swift" / "bin"
TIMEOUT = 400
STEPS = 4
# weights compared to within ATOL: an Adam step moves a weight by up to its learning rate (1e-3) whatever
# the gradient's size, so float32 rounding in a near-zero gradient moves one by about 1e-6
ATOL = 1e-5
# The test's flags after the documented command: a tiny float32 run on CPUs (accelerate runs DDP on CPU
# only with use_cpu; without it each rank would train alone), every step logged and clipped
# (max_grad_norm below each step's norm), a checkpoint every 2 steps, one data order (seeds, no
# eval split, no workers), no versioned subdirectory, nothing asked of the hub.
TINY = (
    "--torch_dtype float32 --use_cpu true --ddp_backend gloo --max_steps 4 --logging_steps 1 --max_grad_norm 0.05 "
    "--save_steps 2 --report_to none --per_device_train_batch_size 2 --learning_rate 1e-3 --seed 0 --data_seed 0 "
    "--dataloader_num_workers 0 --split_dataset_ratio 0 --dataset_num_proc 1 --add_version false --check_model false"
).split()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]  # what swift's qwen3 templates write
ROWS = [(f"what is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a in range(6) for b in range(6)]


def _docs_command(name: str) -> tuple[dict[str, str], list[str]]:
    """``(environment, words)`` of the command of docs/frameworks.md marked ``<!-- command: NAME -->``."""
    text = (ROOT / "docs" / "frameworks.md").read_text()
    found = re.search(rf"<!-- command: {name} -->\n```bash\n(.*?)\n```", text, re.S)
    assert found, f"docs/frameworks.md: the command {name} is gone"
    words = found.group(1).replace("\\\n", " ").split()
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _save_inputs(root: Path) -> tuple[Path, Path]:
    """The model directory (a small Qwen3-MoE, its tokenizer with a chat template) and the data file."""
    from epmoe.models import build_model

    model_dir = root / "model-dir"
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([f"{q} {a}" for q, a in ROWS], trainer)
    chat = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat
    )
    tokenizer.save_pretrained(model_dir)
    model = build_model("qwen3_moe", vocab_size=320, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    model.save_pretrained(model_dir)
    data = root / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in ROWS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data


def _launch(words: list[str], env: dict[str, str], root: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("EPMOE_RUN", "NPROC_PER_NODE")}
    environ.update(env)
    environ.update(
        PATH=os.pathsep.join([str(SWIFT_BIN), environ.get("PATH", "")]),  # swift, and the python it re-launches
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=_free_port(),
        OMP_NUM_THREADS="1",
        USE_HF="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf-home"),  # the datasets cache of the JSONL file, per module
        MODELSCOPE_CACHE=str(root / "modelscope"),
    )
    if words[:2] == ["epmoe", "run"]:
        words = [str(SWIFT_BIN / "python"), "-m", "epmoe.cli", *words[1:]]
    return subprocess.run(words, cwd=root, env=environ, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (out_dir, output)}`` of the five launches."""
    assert (SWIFT_BIN / "swift").exists(), "scripts/setup.sh test builds .venv-swift (ms-swift with its own pins)"
    root = tmp_path_factory.mktemp("swift")
    model_dir, data = _save_inputs(root)
    paths = {"model-dir": str(model_dir), "data.jsonl": str(data)}
    launches = {}
    for kind in ("full", "lora"):
        env, words = _docs_command(f"swift_{kind}")
        assert words[:5] == ["epmoe", "run", "--ep", "2", "--"] and env == {"NPROC_PER_NODE": "2"}, (env, words)
        launches[f"{kind}_ep"] = (env, words)
        launches[f"{kind}_plain"] = (env, words[5:])
    env, words = launches["full_ep"]
    launches["full_resume"] = (env, [*words, "--resume_from_checkpoint", "full_ep/checkpoint-2"])
    results = {}
    for name in ("full_plain", "full_ep", "full_resume", "lora_plain", "lora_ep"):
        env, words = launches[name]
        words = [paths.get(w, str(root / name) if w == "out-dir" else w) for w in words] + TINY
        done = _launch(words, env, root)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{name}: {words}\n{output[-8000:]}"
        results[name] = (root / name, output)
    return results


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def _close(run: list[dict], plain: list[dict], key: str) -> None:
    torch.testing.assert_close(
        torch.tensor([s[key] for s in run], dtype=torch.float64),
        torch.tensor([s[key] for s in plain], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


def test_the_environment_has_swifts_own_pins():
    code = (
        "import importlib.metadata as m; "
        "print(*(m.version(p) for p in ('ms-swift', 'transformers', 'peft', 'trl', 'torch', 'epmoe')))"
    )
    done = subprocess.run([str(SWIFT_BIN / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    swift, transformers_, peft_, trl, torch_, _ = done.stdout.split()
    assert (swift, transformers_, peft_, trl) == ("4.6.0", "5.19.0", "0.20.0", "0.29.1")
    assert torch_.startswith("2.13.0")


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_losses_and_clipped_grad_norms_equal_the_plain_run(runs, kind):
    plain, ep = _steps(runs[f"{kind}_plain"][0]), _steps(runs[f"{kind}_ep"][0])
    assert [s["global_step/max_steps"] for s in ep] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)]
    assert len(plain) == STEPS
    for key in ("loss", "grad_norm"):
        _close(ep, plain, key)
    assert all(step["grad_norm"] > 0.05 for step in plain)  # max_grad_norm 0.05: every step clipped
    state = json.loads((runs[f"{kind}_ep"][0] / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    _close([s for s in state["log_history"] if "loss" in s], plain, "loss")


def test_one_line_per_model_made_expert_parallel_and_nothing_in_the_checkpoints_args(runs):
    """``epmoe run`` hooks swift's ranks through its bootstrap, not swift's ``--external_plugins``: the
    checkpoint's ``args.json`` (which ``swift infer``/``export`` load again) records no plugin of epmoe."""
    for name in ("full_ep", "lora_ep", "full_resume"):
        lines = [line for line in runs[name][1].splitlines() if line.startswith("epmoe run:")]
        assert lines == ["epmoe run: Qwen3MoeForCausalLM expert-parallel, EP size 2 of 2 ranks, over the world group"]
    assert "epmoe run:" not in runs["full_plain"][1] + runs["lora_plain"][1]
    for name in ("full_ep", "lora_ep"):
        args = json.loads((runs[name][0] / f"checkpoint-{STEPS}" / "args.json").read_text())
        assert args["external_plugins"] == [], args["external_plugins"]


def test_the_saved_model_holds_every_expert_whole_and_reloads_in_plain_transformers(runs):
    original = safetensors_torch.load_file(runs["full_plain"][0].parent / "model-dir" / "model.safetensors")
    for step in (2, STEPS):
        plain = safetensors_torch.load_file(runs["full_plain"][0] / f"checkpoint-{step}" / "model.safetensors")
        saved = safetensors_torch.load_file(runs["full_ep"][0] / f"checkpoint-{step}" / "model.safetensors")
        shapes = {k: v.shape for k, v in original.items()}
        assert {k: v.shape for k, v in saved.items()} == shapes == {k: v.shape for k, v in plain.items()}
        assert sum(".mlp.experts." in k for k in saved) == 2 * 3 * 8  # 2 layers x 3 projections x 8 experts
        for key, value in plain.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=ATOL, msg=key)
        assert any(not torch.equal(saved[k], original[k]) for k in saved if ".mlp.experts." in k)  # trained
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["full_ep"][0] / f"checkpoint-{STEPS}")
    reloaded = {k: v for k, v in model.state_dict().items()}
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(runs["full_plain"][0] / f"checkpoint-{STEPS}")
    for key, value in unsharded.state_dict().items():
        torch.testing.assert_close(reloaded[key], value, rtol=1e-5, atol=ATOL, msg=key)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8))).logits).all()


def test_the_lora_adapter_reloads_with_plain_peft_on_the_base_model(runs):
    checkpoint = runs["lora_ep"][0] / f"checkpoint-{STEPS}"
    saved = safetensors_torch.load_file(checkpoint / "adapter_model.safetensors")
    plain = safetensors_torch.load_file(runs["lora_plain"][0] / f"checkpoint-{STEPS}" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(plain) and len(saved) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert all(re.search(r"\.(q_proj|v_proj)\.lora_[AB]\.weight$", k) for k in saved), sorted(saved)
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=ATOL, msg=key)
    assert any(k.endswith("lora_B.weight") and saved[k].abs().max() > 0 for k in saved)  # trained from zero
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["lora_ep"][0].parent / "model-dir")
    model = peft.PeftModel.from_pretrained(base, checkpoint)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    for key, value in saved.items():
        (match,) = [v for k, v in loaded.items() if k.replace(".default", "") == key]
        torch.testing.assert_close(match, value, rtol=0, atol=0, msg=key)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 8))).logits).all()


def test_a_resumed_run_continues_as_the_uninterrupted_one(runs):
    """``--resume_from_checkpoint`` of the EP run's ``checkpoint-2`` (its ``epmoe_dcp/``: the model and
    the optimizer's moments, every expert's), under ``epmoe run`` again: steps 3 and 4 as the run that
    went on, and the same final model."""
    ep, resumed = _steps(runs["full_ep"][0]), _steps(runs["full_resume"][0])
    assert [s["global_step/max_steps"] for s in resumed] == [f"{i}/{STEPS}" for i in range(3, STEPS + 1)]
    for key in ("loss", "grad_norm"):
        _close(resumed, ep[2:], key)
    assert (runs["full_ep"][0] / "checkpoint-2" / "epmoe_dcp").is_dir()
    final = safetensors_torch.load_file(runs["full_ep"][0] / f"checkpoint-{STEPS}" / "model.safetensors")
    again = safetensors_torch.load_file(runs["full_resume"][0] / f"checkpoint-{STEPS}" / "model.safetensors")
    assert sorted(again) == sorted(final)
    for key, value in final.items():
        torch.testing.assert_close(again[key], value, rtol=1e-5, atol=ATOL, msg=key)


def test_lora_on_the_experts_is_refused_by_name_under_swifts_peft(runs):
    """swift's ``--target_parameters`` on the experts: peft 0.20 sizes their factors from this rank's
    shard; ``epmoe run`` refuses at the first forward, naming peft and what serves it."""
    root = runs["lora_ep"][0].parent
    paths = {"model-dir": str(root / "model-dir"), "data.jsonl": str(root / "data.jsonl")}
    env, words = _docs_command("swift_lora")
    words = [paths.get(w, str(root / "experts_lora") if w == "out-dir" else w) for w in words] + TINY
    words += ["--target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "--lora_dropout", "0"]
    done = _launch(words, env, root)
    assert done.returncode != 0
    assert "peft 0.20.0 sized the LoRA factors of down_proj from this rank's shard (4 of 8 experts)" in done.stderr
    assert "Use peft >= 0.21" in done.stderr
