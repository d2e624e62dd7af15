"""``epmoe run -- COMMAND``: a user's own Trainer script (run_script.py, nothing of epmoe in it) launched
as docs/frameworks.md shows, against the same script under plain torchrun (every rank all experts, DDP):
per-step losses and clipped grad norms, the saved checkpoint; and what ``epmoe run`` refuses, the
bootstrap's chaining to the environment's own ``sitecustomize``, and that importing epmoe hooks nothing.

Three launches in all (plain torchrun, ``epmoe run`` over torchrun, over accelerate launch), once per
module; the refusals run single processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("run_script.py")
BIN = Path(sys.executable).parent
TIMEOUT = 300


def _tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EPMOE_RUN"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _docs_command(name: str) -> list[str]:
    """The command of docs/frameworks.md marked ``<!-- command: NAME -->``."""
    text = (ROOT / "docs" / "frameworks.md").read_text()
    found = re.search(rf"<!-- command: {name} -->\n```bash\n(.*?)\n```", text, re.S)
    assert found, f"docs/frameworks.md: the command {name} is gone"
    return found.group(1).split()


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT)


def _epmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "epmoe.cli", "run", *args]


def _save_model(path: Path, moe: bool = True) -> Path:
    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    sizes.update(head_dim=8, intermediate_size=64)
    if moe:
        config = transformers.Qwen3MoeConfig(
            **sizes, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
        )
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    else:
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``{name: (out_dir, stderr)}`` of the three launches of run_script.py on one saved Qwen3-MoE."""
    root = tmp_path_factory.mktemp("run")
    model = _save_model(root / "model-dir")
    script = [str(SCRIPT), str(model)]
    commands = {"plain": ["torchrun", "--nproc-per-node", "2", "train.py", "model-dir", "out-dir"]}
    commands["run_torchrun"] = _docs_command("run_torchrun")
    commands["run_accelerate"] = _docs_command("run_accelerate")
    results = {}
    for name, words in commands.items():
        assert words[words.index("train.py") + 1 :] == ["model-dir", "out-dir"], words
        out = root / name
        port = _free_port()
        argv = [_tool(w) if w in ("torchrun", "accelerate") else w for w in words]
        argv = argv[: argv.index("train.py")] + [*script, str(out)]
        if "launch" in argv:  # accelerate takes its port as an argument
            argv[argv.index("launch") + 1 : argv.index("launch") + 1] = ["--main_process_port", port]
        if argv[0] == "epmoe":
            argv = _epmoe(*argv[2:])
        done = _run(argv, root, PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port)  # torchrun's, from its environment
        assert done.returncode == 0, f"{name}: {argv}\n{done.stdout[-3000:]}{done.stderr[-6000:]}"
        results[name] = (out, done.stderr)
    return results


def _log(out: Path) -> list[dict]:
    return json.loads((out / "log.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["run_torchrun", "run_accelerate"])
def test_losses_and_clipped_grad_norms_equal_the_plain_run(launches, name):
    plain, run = _log(launches["plain"][0]), _log(launches[name][0])
    assert len(plain) == len(run) == 4
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(
            torch.tensor([s[key] for s in run]), torch.tensor([s[key] for s in plain]), rtol=1e-5, atol=0
        )
    assert all(step["grad_norm"] > 0.05 for step in plain)  # max_grad_norm=0.05: every step clipped


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["run_torchrun", "run_accelerate"])
def test_saved_model_is_the_unsharded_one(launches, name, tmp_path):
    plain = safetensors_torch.load_file(launches["plain"][0] / "model.safetensors")
    saved = safetensors_torch.load_file(launches[name][0] / "model.safetensors")
    original = safetensors_torch.load_file(launches["plain"][0].parent / "model-dir" / "model.safetensors")
    shapes = {k: v.shape for k, v in original.items()}
    assert {k: v.shape for k, v in saved.items()} == shapes == {k: v.shape for k, v in plain.items()}
    experts = {re.sub(r"experts\.\d+\.", "experts.E.", k) for k in saved if ".mlp.experts." in k}
    assert len(experts) == 2 * 3  # every expert of both layers, whole: 8 of each projection
    assert all(f"experts.{i}." in " ".join(saved) for i in range(8))
    assert sum(".mlp.experts." in k for k in saved) == 2 * 3 * 8
    for key, value in plain.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-6, msg=key)
    model = transformers.AutoModelForCausalLM.from_pretrained(launches[name][0])  # plain transformers
    ids = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.multirank
def test_one_line_per_model_made_expert_parallel(launches):
    lines = [line for line in launches["run_torchrun"][1].splitlines() if line.startswith("epmoe run:")]
    assert lines == ["epmoe run: Qwen3MoeForCausalLM expert-parallel, EP size 2 of 2 ranks, over the world group"]
    lines = [line for line in launches["run_accelerate"][1].splitlines() if line.startswith("epmoe run:")]
    assert lines == [
        "epmoe run: Qwen3MoeForCausalLM expert-parallel, EP size 1 of 2 ranks, over a ('dp', 'ep') mesh of 2 x 1"
    ]
    assert "epmoe run" not in launches["plain"][1]


@pytest.mark.parametrize(
    "config, named",
    [('{"no_such_field": 1}', "no_such_field"), ('{"dispatch": "sideways"}', "dispatch"), ("[1]", "JSON object")],
)
def test_a_bad_config_exits_2_naming_it_and_runs_nothing(config, named, tmp_path, monkeypatch, capsys):
    from epmoe.cli import main

    started = []
    monkeypatch.setattr(os, "execvpe", lambda *args: started.append(args))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--config", config, "--", "touch", str(tmp_path / "ran")])
    assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert started == [] and not (tmp_path / "ran").exists()


def test_a_missing_command_exits_2_naming_it(monkeypatch, capsys):
    from epmoe.cli import main

    started = []
    monkeypatch.setattr(os, "execvpe", lambda *args: started.append(args))
    assert main(["run", "--ep", "2", "--", "no-such-command-here", "x"]) == 2
    assert "'no-such-command-here'" in capsys.readouterr().err
    assert main(["run"]) == 2 and "no command" in capsys.readouterr().err
    assert started == []


def test_the_command_gets_the_settings_and_the_bootstrap(monkeypatch):
    from epmoe.cli import main, run

    started = []
    monkeypatch.setattr(os, "execvpe", lambda *args: started.append(args))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    main(["run", "--ep", "4", "--config", '{"timeout": 60}', "--", "true", "a"])
    ((program, argv, env),) = started
    assert argv == ["true", "a"] and Path(program).name == "true"
    assert json.loads(env["EPMOE_RUN"]) == {"ep": 4, "config": {"timeout": 60}}
    assert env["PYTHONPATH"] == os.pathsep.join([str(run.BOOTSTRAP), "/elsewhere"])
    assert sorted(p.name for p in run.BOOTSTRAP.iterdir() if p.suffix == ".py") == ["sitecustomize.py"]


@pytest.mark.multirank
def test_a_single_process_is_refused_by_name(tmp_path):
    model = _save_model(tmp_path / "model")
    done = _run(_epmoe("--", sys.executable, str(SCRIPT), str(model), str(tmp_path / "out")), tmp_path)
    assert done.returncode != 0
    assert "epmoe run: Qwen3MoeForCausalLM was loaded in a single process with no process group" in done.stderr
    assert "torchrun" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.multirank
def test_a_model_without_experts_is_refused_by_name(tmp_path):
    model = _save_model(tmp_path / "dense", moe=False)
    done = _run(_epmoe("--", sys.executable, str(SCRIPT), str(model), str(tmp_path / "out")), tmp_path)
    assert done.returncode != 0
    assert "epmoe run: Qwen3ForCausalLM has no experts module epmoe can serve" in done.stderr
    assert "needs a MoE model" in done.stderr


PROBE = (
    "import os, sys; "
    "print(os.environ.get('SITE_MARKER'), 'transformers' in sys.modules, "
    "[type(f).__name__ for f in sys.meta_path].count('_Finder'))"
)


@pytest.mark.multirank
def test_the_bootstrap_chains_to_the_environments_sitecustomize(tmp_path):
    """A ``sitecustomize`` already on PYTHONPATH still runs under ``epmoe run``; the hooks are installed
    without importing transformers, and only where ``epmoe run`` started the process."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_MARKER'] = 'ran'\n")
    path = os.pathsep.join([str(site), str(ROOT / "src")])
    under = _run(_epmoe("--", sys.executable, "-c", PROBE), tmp_path, PYTHONPATH=path)
    assert under.returncode == 0, under.stderr
    assert under.stdout.split() == ["ran", "False", "1"]
    alone = _run([sys.executable, "-c", PROBE], tmp_path, PYTHONPATH=path)
    assert alone.stdout.split() == ["ran", "False", "0"]


def test_importing_epmoe_hooks_nothing():
    from transformers import PreTrainedModel, Trainer

    import epmoe  # noqa: F401

    assert PreTrainedModel.from_pretrained.__func__.__module__ == "transformers.modeling_utils"
    assert not hasattr(PreTrainedModel.from_pretrained, "__wrapped__")
    assert Trainer.__init__.__module__ == "transformers.trainer" and not hasattr(Trainer.__init__, "__wrapped__")
    assert "__init_subclass__" not in Trainer.__dict__
    assert not any(type(f).__name__ == "_Finder" for f in sys.meta_path)


TRAINER_FROM_CONFIG = """
import transformers
config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=8, intermediate_size=32)
args = transformers.TrainingArguments(output_dir="out", report_to=[], use_cpu=True)
transformers.Trainer(model=transformers.Qwen3ForCausalLM(config), args=args)
"""


@pytest.mark.multirank
def test_a_trainer_on_a_model_built_otherwise_is_refused_and_the_exit_says_so(tmp_path):
    """A model built from a config (no from_pretrained): its Trainer is refused by name, and rank 0's
    exit says no MoE model was made expert-parallel."""
    done = _run(_epmoe("--", sys.executable, "-c", TRAINER_FROM_CONFIG), tmp_path, RANK="0")
    assert done.returncode != 0
    assert "epmoe run: Trainer's model (Qwen3ForCausalLM) is not expert-parallel" in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("epmoe run: the command built no MoE model")
