"""The README and docs/ hold together: the README stays short and starts with the two commands, every
relative link (and its anchor) resolves, and docs/api.md names every public name of the package.

The recipes in these pages are run by tests/project/test_readme.py; the families table in docs/models.md is
checked by tests/models/test_families.py.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
API = DOCS / "api.md"
README_MAX_LINES = 250
README_START = (
    "# epmoe\n\n```bash\nscripts/setup.sh && .venv/bin/epmoe demo\n"
    "scripts/setup.sh test && .venv/bin/python -m pytest -q\n```\n"
)

# The subpackages whose __all__ docs/api.md must cover, and the public names outside any __all__ the
# recipes and pages use.
SUBPACKAGES = (
    "epmoe.platform",
    "epmoe.gmm",
    "epmoe.comm",
    "epmoe.training",
    "epmoe.checkpoint",
    "epmoe.ep",
    "epmoe.compose",
)
OTHER_PUBLIC = (
    "epmoe.__version__",
    "epmoe.models.build_model",
    "epmoe.models.FAMILIES",
    "epmoe.launch.run_ranks",
    "epmoe.launch.RankError",
    "epmoe.launch.START_METHODS",
    "epmoe.launch.free_port",
    "epmoe.training.fsdp.shard_dense",
    "epmoe.checkpoint.state_dict_warning.ExpertStateDictWarning",
)

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", re.M)


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (link text in backticks stays a link)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "``", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (GitHub's: a repeated slug gets ``-1``, ``-2`` ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert text.startswith(README_START), "README.md must open with `# epmoe` and the two commands"
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def test_readme_links_every_docs_page():
    linked = {target.split("#")[0] for target in LINK.findall(prose(README.read_text()))}
    missing = sorted(f"docs/{page.name}" for page in DOCS.glob("*.md") if f"docs/{page.name}" not in linked)
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """Every link that is not a URL names an existing file, and its ``#anchor`` a heading there."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def _resolve(dotted: str):
    """The object a dotted name names (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def public_names() -> list[str]:
    """Every public name of the package, qualified: ``epmoe.__all__``, the subpackages' ``__all__`` (a
    name the top level exports as the same object counts as documented under either), and
    :data:`OTHER_PUBLIC`."""
    import epmoe

    names = [f"epmoe.{name}" for name in epmoe.__all__]
    for module_name in SUBPACKAGES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__]
    return names + list(OTHER_PUBLIC)


def test_api_reference_names_every_public_name():
    import epmoe

    text = API.read_text()
    missing = []
    for dotted in public_names():
        obj = _resolve(dotted)  # the name exists
        name = dotted.rsplit(".", 1)[1]
        top_level = f"epmoe.{name}" if name in epmoe.__all__ and getattr(epmoe, name) is obj else None
        if not re.search(rf"`{re.escape(dotted)}\b", text) and not (
            top_level and re.search(rf"`{re.escape(top_level)}\b", text)
        ):
            missing.append(dotted)
    assert not missing, f"docs/api.md does not name: {missing}"


def test_api_reference_names_only_what_exists():
    """Each entry's heading (``### `epmoe....```) names a real object, so a removed name fails here."""
    headings = re.findall(r"^### `(epmoe\.[\w.]+)", API.read_text(), re.M)
    assert len(headings) > 40
    for dotted in headings:
        _resolve(dotted)
