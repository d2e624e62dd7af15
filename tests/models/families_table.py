"""Rewrite the families table of docs/models.md from the coverage test's run (tests/models/test_families.py).

    PYTHONPATH=src:tests/support python tests/models/families_table.py          # prints the table
    PYTHONPATH=src:tests/support python tests/models/families_table.py --write  # and writes it into docs/models.md

The table sits between the ``<!-- families:begin -->`` and ``<!-- families:end -->`` lines of that page;
reading and writing go by those two markers.

Every MoE family of the installed transformers (found by structure: tests/support/families.py) runs at EP 2 in
fp64 on 2 gloo ranks (tests/models/families_workers.py); its verdict is the table's second column, and the
third says whether transformers' own expert parallelism has a plan for it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "models.md"  # the page holding the families table
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


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


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """``{family: (verdict, transformers' EP plan)}`` read back from the table in ``text`` (the text of
    :data:`PAGE`), between the :data:`BEGIN` and :data:`END` markers."""
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.strip().splitlines()[2:]]
    return {name: (verdict, plan) for name, verdict, plan in rows}


def table_verdicts(text: str) -> dict[str, str]:
    """``{family: verdict}`` read back from the table in ``text`` (the text of :data:`PAGE`)."""
    return {name: verdict for name, (verdict, _) in table_rows(text).items()}


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
        before, rest = PAGE.read_text().split(BEGIN, 1)
        PAGE.write_text(f"{before}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
