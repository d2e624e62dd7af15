"""Rewrite the families table of docs/models.md for the installed transformers release from the coverage
test's run (tests/models/test_families.py).

    PYTHONPATH=src:tests/support python tests/models/families_table.py          # prints the table
    PYTHONPATH=src:tests/support python tests/models/families_table.py --write  # and writes it into docs/models.md

The page holds one table per tested release (``major.minor``), each between the
``<!-- families X.Y:begin -->`` and ``<!-- families X.Y:end -->`` lines; reading and writing go by
those markers, and each table is written and checked by the environment running that release. A
release without a table yet gets one written after the last.

Every MoE family of the installed transformers (found by structure: tests/support/families.py) runs at EP 2 in
fp64 on 2 gloo ranks (tests/models/families_workers.py); its verdict is the table's second column, and the
third says whether transformers' own expert parallelism has a plan for it.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "models.md"  # the page holding the families tables


def release() -> str:
    """The installed transformers' ``major.minor``: the table it writes and checks."""
    from epmoe.integrations.releases import installed_transformers

    return ".".join(installed_transformers().split(".")[:2])


def markers(of: str) -> tuple[str, str]:
    """The lines around release ``of``'s table."""
    return f"<!-- families {of}:begin -->", f"<!-- families {of}:end -->"


def releases(text: str) -> list[str]:
    """The releases ``text`` (the text of :data:`PAGE`) holds a table of, in page order."""
    return re.findall(r"<!-- families (\S+):begin -->", text)


def table(verdicts: dict[str, str]) -> str:
    """The Markdown table of ``{family: verdict}``, by family name, with whether transformers' own
    expert parallelism has a plan for it (:func:`epmoe.bench.versus.ep_plans`)."""
    from epmoe.bench.versus import ep_plans

    plans = ep_plans()
    rows = [
        "| family (transformers model directory) | verdict at EP 2 (fp64; bf16 within 1.5x the distance without EP) "
        "| transformers' own EP plan |",
        "|---|---|---|",
    ]
    rows += [
        f"| {name} | {verdict.replace('|', '/')} | {'yes' if name in plans else 'no'} |"
        for name, verdict in sorted(verdicts.items())
    ]
    return "\n".join(rows)


def table_rows(text: str, of: str | None = None) -> dict[str, tuple[str, str]]:
    """``{family: (verdict, transformers' EP plan)}`` read back from release ``of``'s table in ``text``
    (the text of :data:`PAGE`; ``of``: the installed release, or the page's last table where it has
    none, as scripts/update-pins.sh compares new pins with it)."""
    of = of or release()
    if of not in releases(text):
        of = releases(text)[-1]
    begin, end = markers(of)
    section = text.split(begin, 1)[1].split(end, 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.strip().splitlines()[2:]]
    return {name: (verdict, plan) for name, verdict, plan in rows}


def table_verdicts(text: str, of: str | None = None) -> dict[str, str]:
    """``{family: verdict}`` read back from release ``of``'s table in ``text`` (:func:`table_rows`)."""
    return {name: verdict for name, (verdict, _) in table_rows(text, of).items()}


def run_verdicts() -> dict[str, str]:
    """Every family's verdict from one spawned 2-rank run."""
    from families import families
    from families_workers import check_families, verdict

    from epmoe.launch import run_ranks

    found = [f for f in families() if not isinstance(f, str)]
    results = run_ranks(check_families, 2, found, timeout=900)
    out = {f.name: verdict(f, [r[f.name] for r in results]) for f in found}
    out.update({name: "error: no tiny model of it could be built" for name in families() if isinstance(name, str)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the table into docs/models.md")
    args = parser.parse_args(argv)
    text = table(run_verdicts())
    print(text)
    if args.write:
        page, (begin, end) = PAGE.read_text(), markers(release())
        if release() not in releases(page):  # a new release: its table after the last one
            last = markers(releases(page)[-1])[1]
            before, after = page.split(last, 1)
            page = f"{before}{last}\n\nAt transformers {release()}:\n\n{begin}\n{end}{after}"
        before, rest = page.split(begin, 1)
        PAGE.write_text(f"{before}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
