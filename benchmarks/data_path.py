"""The functions of epmoe one training step of an EP model passes through: the data path, measured.

    python benchmarks/data_path.py [--json]

Builds the small Qwen3-MoE (``epmoe.models.build_model("qwen3_moe")``), makes it expert-parallel over
2 gloo ranks (``epmoe.launch.run_ranks``), runs two forward + backward steps under ``sys.setprofile``,
and records every distinct function of the ``epmoe`` package called in each (comprehensions and
lambdas aside: they are parts of the function that holds them). The second, steady step is the data
path every step runs; the first step also runs what is decided once (the grouped-matmul backend's
judgement, first-use logs, the expert parameters' marks). Prints how many functions and files each
step runs and how many files one layer call enters (what a reader of the layer opens: the forward
inside ``routed_experts`` and the backward), then each function of the steady step with its body's
length in lines (``!`` marks one over :data:`MAX_FUNCTION_LINES`). ``--json`` prints the same as one JSON object (the test reads it).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import textwrap
from pathlib import Path

import torch

import epmoe
from epmoe.launch import run_ranks
from epmoe.models import build_model

EP_SIZE = 2
MAX_FUNCTION_LINES = 60  # the goal: no function on the path longer than this
PACKAGE_DIR = str(Path(epmoe.__file__).resolve().parent)
SKIPPED = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>"}


def _lines(code) -> int:
    """A function's body length in source lines (its docstring included; not its decorators and
    signature, which the formatter lays out one parameter per line)."""
    try:
        source, _ = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return 0
    node = ast.parse(textwrap.dedent("".join(source))).body[0]
    return node.end_lineno - node.body[0].lineno + 1


def _profiled_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[tuple[str, str, int, int]], dict]:
    """``(functions, layer_files)``: ``(file, qualified name, first line, length)`` of every epmoe
    function one forward + backward of ``model`` on ``ids`` calls, and the files one layer call enters:
    ``{"forward": [...], "backward": [...]}``, those entered inside one call of
    :func:`epmoe.ep.layer.routed_experts` (the last layer's), and those the backward enters (every
    layer's backward runs the same code: what one layer's enters)."""
    seen, forward_files, backward_files = {}, set(), set()
    inside = {"layer": None, "files": set(), "backward": False}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "return" and frame is inside["layer"]:
            inside["layer"] = None
            forward_files.clear()
            forward_files.update(inside["files"])  # the last layer call's
        if event != "call" or not code.co_filename.startswith(PACKAGE_DIR) or code.co_name in SKIPPED:
            return
        seen.setdefault((code.co_filename, code.co_firstlineno), code)
        file = _relative(code.co_filename)
        if code.co_name == "routed_experts" and inside["layer"] is None and not inside["backward"]:
            inside["layer"], inside["files"] = frame, set()
        if inside["layer"] is not None:
            inside["files"].add(file)
        if inside["backward"]:
            backward_files.add(file)

    sys.setprofile(profile)
    try:
        loss = model(ids, labels=ids).loss
        inside["backward"] = True
        loss.backward()
    finally:
        sys.setprofile(None)
    model.zero_grad(set_to_none=True)
    functions = sorted((_relative(file), code.co_qualname, line, _lines(code)) for (file, line), code in seen.items())
    return functions, {"forward": sorted(forward_files), "backward": sorted(backward_files)}


def _relative(file: str) -> str:
    """A file of the package, relative to it."""
    return str(Path(file).relative_to(PACKAGE_DIR))


def _step_functions(rank: int, world: int) -> tuple[list, list, dict]:
    """:func:`_profiled_step` of the EP model's first step and of its second (steady) step on this rank:
    ``(first step's functions, steady step's functions, steady step's files per layer call)``."""
    torch.manual_seed(0)
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    first, _ = _profiled_step(model, ids)  # backends judged, first uses logged, expert parameters marked
    return (first, *_profiled_step(model, ids))


def measure() -> dict:
    """The union over the ranks of :func:`_step_functions`: ``{"functions": [...], "files": [...],
    "layer_files": {"forward": [...], "backward": [...], "call": n}, "over": [...], "first_step":
    {"functions": n, "files": n}}``, each function of the steady step as ``[file, name, first line,
    lines]``; ``layer_files["call"]``: the files one layer call enters, forward and backward together;
    ``over`` counts the first step's too."""
    per_rank = run_ranks(_step_functions, EP_SIZE, timeout=600)
    first = sorted({tuple(f) for rank_first, _, _ in per_rank for f in rank_first})
    functions = sorted({tuple(f) for _, rank_steady, _ in per_rank for f in rank_steady})
    layer = {part: sorted({f for _, _, files in per_rank for f in files[part]}) for part in ("forward", "backward")}
    return {
        "functions": [list(f) for f in functions],
        "files": sorted({f[0] for f in functions}),
        "layer_files": {**layer, "call": len(set(layer["forward"]) | set(layer["backward"]))},
        "over": [list(f) for f in sorted(set(first) | set(functions)) if f[3] > MAX_FUNCTION_LINES],
        "first_step": {"functions": len(first), "files": len({f[0] for f in first})},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        print(json.dumps(result))
        return
    functions, files, first = result["functions"], result["files"], result["first_step"]
    print(
        f"qwen3_moe at EP {EP_SIZE}, one forward + backward: steady step {len(functions)} functions in "
        f"{len(files)} files, first step {first['functions']} in {first['files']} "
        f"({len(result['over'])} over {MAX_FUNCTION_LINES} lines)"
    )
    layer = result["layer_files"]
    print(
        f"one layer call enters {layer['call']} files: forward {len(layer['forward'])} "
        f"({', '.join(layer['forward'])}), backward {len(layer['backward'])} ({', '.join(layer['backward'])})"
    )
    for file in files:
        print(f"\n{file}")
        for _, name, line, length in (f for f in functions if f[0] == file):
            flag = "!" if length > MAX_FUNCTION_LINES else " "
            print(f"  {flag} {length:4d}  {name} (line {line})")


if __name__ == "__main__":
    main()
