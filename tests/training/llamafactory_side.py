"""The side of tests/training/test_llamafactory.py that runs in ``.venv-llamafactory`` (LLaMA-Factory's own pins).

``python llamafactory_side.py build ROOT`` writes what the launches read, under ROOT: ``model-dir`` (a
2-layer Qwen3-MoE of 8 experts, top-2, built from a config by ``epmoe.models.build_model`` and saved
with this environment's transformers, with a word-level tokenizer built with ``tokenizers`` and a chat
template), ``data-dir`` (16 alpaca-style rows registered in ``dataset_info.json`` as ``tiny``) and
``versions.json`` (what this environment holds).

``python llamafactory_side.py reload ROOT`` reloads what the launches saved with plain transformers and
peft (no epmoe, nothing of LLaMA-Factory): each full model and each adapter, with the keys transformers
reports missing or unexpected, and their logits on fixed ids against the run without EP's; writes
``reload.json``.
"""

import importlib.metadata
import importlib.util
import json
import random
import sys
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<pad>", "<unk>", "<eos>"]
# the template `default` writes "Human: ...\nAssistant: ..."; Whitespace splits off the colons
VOCAB = SPECIAL + WORDS + ["Human", "Assistant", ":"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"


def _versions() -> dict:
    out = {}
    for name in ("llamafactory", "transformers", "peft", "trl", "accelerate", "datasets", "torch"):
        out[name] = importlib.metadata.version(name)
    for name in ("torchaudio", "torchvision"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "stand-in" if importlib.util.find_spec(name) else None
    return out


def build(root: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from epmoe.models import build_model

    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    model = build_model("qwen3_moe", num_experts=8, top_k=2, vocab_size=len(VOCAB), eos_token_id=2, pad_token_id=0)
    model.config._experts_implementation = None  # the release's default, as a downloaded checkpoint has it
    model.save_pretrained(root / "model-dir")
    fast.save_pretrained(root / "model-dir")
    rng = random.Random(0)
    rows = [
        {"instruction": " ".join(rng.choices(WORDS, k=6)), "input": "", "output": " ".join(rng.choices(WORDS, k=8))}
        for _ in range(16)
    ]
    data = root / "data-dir"
    data.mkdir()
    (data / "tiny.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    (root / "versions.json").write_text(json.dumps(_versions()))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def reload(root: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(0))
    base = _logits(AutoModelForCausalLM.from_pretrained(root / "model-dir"), ids)
    out = {}
    for name in ("full", "lora"):
        logits = {}
        for run in ("plain", "ep"):
            if name == "full":
                model, info = AutoModelForCausalLM.from_pretrained(root / f"{run}-{name}", output_loading_info=True)
                out[f"{run}-{name} loading"] = {k: sorted(map(str, v)) for k, v in info.items()}
            else:
                model = PeftModel.from_pretrained(
                    AutoModelForCausalLM.from_pretrained(root / "model-dir"), root / f"{run}-{name}"
                )
            logits[run] = _logits(model, ids)
        out[name] = {
            "ep_vs_plain": (logits["ep"] - logits["plain"]).abs().max().item(),
            "trained_vs_base": (logits["ep"] - base).abs().max().item(),
        }
    (root / "reload.json").write_text(json.dumps(out))


if __name__ == "__main__":
    {"build": build, "reload": reload}[sys.argv[1]](Path(sys.argv[2]))
