"""The house: every import of an ``epmoe`` module goes down the floors docs/design.md draws, none sits
inside a function of library code, and no two modules import each other (directly or around a cycle)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "epmoe"

FLOORS = [  # lowest first; a module may import its own floor and the ones below
    ("epmoe.platform", "epmoe.errors"),
    ("epmoe.gmm", "epmoe.comm"),
    ("epmoe.ep",),
    ("epmoe.integrations", "epmoe.models"),
    ("epmoe.checkpoint", "epmoe.training"),
    ("epmoe.compose",),
    ("epmoe", "epmoe.launch", "epmoe.cli", "epmoe.bench", "epmoe.demo"),
]
LAZY_ALLOWED = ("epmoe.cli", "epmoe.bench", "epmoe.demo")  # start-up time: the tools may import late
WITHIN_FLOOR_ORDER = {"epmoe.checkpoint": 0, "epmoe.training": 1}  # training may use checkpoints, not back


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, pathlib.Path]) -> list[tuple[str, str, bool]]:
    """``(importer, imported epmoe module, inside a function)`` for every import in the package."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != "epmoe":
                    continue
                while target not in modules:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    edges.append((name, target, id(node) in in_function))
    return edges


def _floor(module: str) -> tuple[int, int]:
    best = None
    for level, packages in enumerate(FLOORS):
        for package in packages:
            if module == package or module.startswith(package + ".") and package != "epmoe":
                if best is None or len(package) > len(best[1]):
                    best = (level, package)
    if best is None:
        return len(FLOORS) - 1, 0
    return best[0], WITHIN_FLOOR_ORDER.get(best[1], 0)


def test_every_module_has_a_floor():
    unplaced = [
        m
        for m in _modules()
        if m != "epmoe" and not any(m == p or m.startswith(p + ".") for floor in FLOORS for p in floor if p != "epmoe")
    ]
    assert unplaced == []


def test_imports_only_go_down():
    upward = [(a, b) for a, b, _ in _imports(_modules()) if _floor(b) > _floor(a)]
    assert upward == [], upward


def test_no_epmoe_import_inside_library_functions():
    lazy = [(a, b) for a, b, local in _imports(_modules()) if local and not a.startswith(LAZY_ALLOWED)]
    assert lazy == [], lazy


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for a, b, _ in _imports(_modules()):
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail(f"import cycle: {' -> '.join(path[path.index(nxt) :] + [nxt])}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_an_upward_import():
    """The floor rule can fail: the engine importing composition would be caught."""
    assert _floor("epmoe.compose.apply") > _floor("epmoe.ep.layer")
    assert _floor("epmoe.training.trainer") > _floor("epmoe.checkpoint.save")
    assert any(a == "epmoe.ep.layer" and b == "epmoe.ep.dispatch" for a, b, _ in _imports(_modules()))


LAYER_ONLY = (
    "epmoe.ep.state",
    "epmoe.ep.experts",
    "epmoe.ep.expert_weights",
    "epmoe.ep.expert_lora",
    "epmoe.ep.guard",
    "epmoe.ep.recognize",
    "epmoe.ep.model",
)


def _reached_from(prefix: str) -> set[str]:
    """Every epmoe module the modules under ``prefix`` import, directly or through others."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in _imports(_modules()):
        graph.setdefault(a, set()).add(b)
    reached, todo = set(), [m for m in graph if m == prefix or m.startswith(prefix + ".")]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    return reached


def test_transports_only_move_tokens():
    """The transports know nothing of the layer: not its state, its experts, the step guard, the
    recognizer or the model's record (the layer, epmoe.ep.layer, runs those and hands them a Link)."""
    assert sorted(_reached_from("epmoe.ep.dispatch") & set(LAYER_ONLY)) == []
    assert set(LAYER_ONLY) <= _reached_from("epmoe.ep.layer")  # the check can fail: the layer reaches them


def _top_level_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_tests_and_benchmarks_do_not_import_each_other():
    """Benchmark code is epmoe.bench (what users run) or a script of benchmarks/ (one-off measurements);
    tests import neither benchmarks/ scripts nor are imported by them (a test may run a script)."""
    root = SRC.parents[1]
    tests, benchmarks = sorted((root / "tests").rglob("*.py")), sorted((root / "benchmarks").glob("*.py"))
    test_names, bench_names = {p.stem for p in tests}, {p.stem for p in benchmarks}
    crossing = [(p.name, n) for p in benchmarks for n in _top_level_imports(p) & test_names]
    crossing += [(p.name, n) for p in tests for n in _top_level_imports(p) & bench_names]
    crossing += [
        (p.name, "benchmarks/") for p in tests if re.search(r"spec_from_file_location\([^)]*benchmarks", p.read_text())
    ]
    assert crossing == []
    assert bench_names and test_names  # the check sees both sides
