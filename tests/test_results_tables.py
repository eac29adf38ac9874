"""Every docs table that names a data file is that file's table, cell for cell.

A page marks a table with `<!-- table: data/NAME.json#TABLE -->` on the line before it; the data file
(docs/results/data/NAME.json) holds its rows as numbers and its columns with how each number is shown.
A change is computed from the two accuracies it joins, never stored, so a row cannot state a change its
own numbers do not give. The README's demo row and its SmolLM2 sentence are checked against the same files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_docs import readme_demo_row

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MARKER = re.compile(r"<!-- table: (data/[\w-]+\.json)#(\w+) -->")


def value(row: dict, key: str):
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def change_points(row: dict) -> float:
    return round(100 * (row["grpo"]["greedy"] - row["sft"]["greedy"]), 1)


# How a number is shown, by a column's "format" (text: as it is).
FORMATS = {
    "pct": "{:.1%}".format,
    "arrow": lambda v: f"{v[0]:.1%} → {v[1]:.1%}",
    "arrow0": lambda v: f"{v[0]:.0%} → {v[1]:.0%}",
    "arrow_change": lambda v: f"**{100 * (v[1] - v[0]):+.1f} pt**",
    "interval": lambda v: f"[{v[0]:+.1f}, {v[1]:+.1f}] pt",
    "minutes": lambda v: f"{v:,} s ({v / 60:.1f} min)",
    "seconds": "{:.2f} s".format,
    "seconds1": "{:.1f} s".format,
    "gib": lambda v: f"{v / 2**30:.2f} GiB",
    "rate": "{:,.0f}".format,
    "giga": lambda v: f"{v / 1e9:,.1f}",
}


def cell(row: dict, column: dict, interval_column: bool) -> str:
    """One cell as the page shows it; empty where the row has no such number. A change carries its
    interval in brackets unless the table gives the interval a column of its own."""
    fmt, v = column.get("format", "text"), value(row, column["key"])
    if fmt == "change":
        interval = None if interval_column else row.get("interval")
        return f"**{change_points(row):+.1f} pt**" + (f" [{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else "")
    if v is None:
        return ""
    return FORMATS.get(fmt, str)(v)


def render(table: dict) -> list[str]:
    """The Markdown table: header, rule, one line per row."""
    columns = table["columns"]
    lines = ["| " + " | ".join(c["title"] for c in columns) + " |", "|" + "---|" * len(columns)]
    interval_column = any(c["key"] == "interval" for c in columns)
    for row in table["rows"]:
        lines.append("| " + " | ".join(cell(row, c, interval_column) for c in columns) + " |")
    return lines


def marked_tables():
    """(page, line number, data file, table name, the table's lines) of every marked table."""
    found = []
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts]  # a guide may show one too
    for page in sorted([*pages, ROOT / "README.md", ROOT / "BENCHMARKS.md"]):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = MARKER.search(line)
            if match:
                body = []
                for text in lines[i + 1:]:
                    if not text.startswith("|"):
                        break
                    body.append(text.rstrip())
                found.append(pytest.param(page, *match.groups(), body, id=f"{page.name}:{i + 1}"))
    return found


def test_the_results_pages_mark_their_tables():
    named = {(p.values[1], p.values[2]) for p in marked_tables()}
    assert {("data/demo.json", "accuracy"), ("data/demo.json", "history"), ("data/smollm2.json", "seeds")} <= named


@pytest.mark.parametrize(("page", "data", "name", "body"), marked_tables())
def test_a_marked_table_is_its_data_files(page, data, name, body):
    table = json.loads((RESULTS / data).read_text())["tables"][name]
    expected = render(table)
    assert body == expected, (f"{page.name}'s table {data}#{name} disagrees with its data file; from the data it "
                              "reads:\n" + "\n".join(expected))


OUTPUT = re.compile(r"<!-- output: (data/[\w-]+\.json) -->")


def test_a_benchmarks_printed_output_on_a_page_is_its_data_files():
    """`<!-- output: data/NAME.json -->`: the lines after it are the `table` the benchmark printed and saved
    (benchmarks/vs_trl.py writes its printed tables to its --json file), word for word."""
    shown = 0
    for page in sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = OUTPUT.search(line)
            if match:
                printed = json.loads((RESULTS / match.group(1)).read_text())["table"].strip().splitlines()
                assert lines[i + 1:i + 1 + len(printed)] == printed, f"{page.name}:{i + 1} differs from {match.group(1)}"
                shown += 1
    assert shown >= 1


def test_a_table_that_disagrees_with_its_data_fails():
    table = json.loads((RESULTS / "data" / "demo.json").read_text())["tables"]["accuracy"]
    lines = render(table)
    row = table["rows"][0]
    row["grpo"]["greedy"] += 0.001
    changed = render(table)
    assert changed[2] != lines[2] and f"{row['grpo']['greedy']:.1%}" in changed[2]
    assert f"**{change_points(row):+.1f} pt**" in changed[2] and f"**{change_points(row):+.1f} pt**" not in lines[2]


def test_the_readme_demo_row_is_the_data_files():
    row = next(r for table in json.loads((RESULTS / "data" / "demo.json").read_text())["tables"].values()
               for r in table["rows"] if r.get("readme"))
    pct = "{:.1%}".format
    assert readme_demo_row() == [str(row["seed"]), pct(row["sft"]["greedy"]), pct(row["grpo"]["greedy"]),
                                 f"**{change_points(row):+.1f} pt**", pct(row["sft"]["pass"]), pct(row["grpo"]["pass"]),
                                 pct(row["sft"]["maj"]), pct(row["grpo"]["maj"]),
                                 f"{pct(row['tir'][0])} → {pct(row['tir'][1])}"]


def test_the_readme_smollm2_sentence_is_the_data_files():
    rows = json.loads((RESULTS / "data" / "smollm2.json").read_text())["tables"]["seeds"]["rows"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for row in rows:
        before = f"{row['sft']['greedy']:.1%} → " if row["seed"] == 0 else "→ "
        lo, hi = row["interval"]
        said = (f"seed {row['seed']} {before}{row['grpo']['greedy']:.1%} (**{change_points(row):+.1f} pt**, "
                f"[{lo:+.1f}, {hi:+.1f}])")
        assert said in readme, said
