"""A results page's prose agrees with its tables: every accuracy (a %) and every change (points, pt) that a
sentence states is a number the page's tables show or its data files hold, or one the page lists, with
where it comes from, as a number its tables do not hold.

Checked on every page under docs/results/ that marks a table from a data file (tests/test_results_tables.py
checks those tables cell for cell against the files). A number counts as shown when it is:
- in a cell of one of the page's tables;
- a value of one of the page's data files as its tables show it: a fraction in percent, a change in
  points (GRPO's greedy accuracy minus π_SFT's, or a "before → after" pair's), an interval's end;
- a whole number that one of those rounds to (a sentence may say "96%" for a cell's 95.7%);
- listed on the page as `<!-- prose numbers not in a table: 32.6% 7.2% ...: why -->` (older runs that no
  data file holds, a bar, a paper's numbers), so an unchecked number is one a reader can see is unchecked.
A range ("16.2 to 49.2 points", "45.0%–58.6%") is checked at both ends.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
MARKER = re.compile(r"<!-- table: (data/[\w-]+\.json)#\w+ -->")
LISTED = re.compile(r"<!-- prose numbers not in a table: (.*?)-->", re.S)
_N = r"[+−-]?\d+(?:\.\d+)?"
# a number (or a range of two) with its unit; the unit may follow the range's second number only
CLAIM = re.compile(rf"(?<![\w.+−-])({_N})(%|\s?pt\b|\s?points?\b)?(?:\s?(?:–|to|-)\s?({_N}))?(%|\s?pt\b|\s?points?\b)")
CELL_NUMBER = re.compile(_N)


def _plain(number: str) -> str:
    """"+16.2" and "16.2" and "−3.4" as one spelling: no sign for positives, ASCII minus."""
    number = number.replace("−", "-")
    return number[1:] if number.startswith("+") else number


def _data_numbers(value) -> tuple[set[str], set[str]]:
    """(percents, points) a data file's values show as: fractions in percent; a row's greedy change and a
    "before → after" pair's change in points; any other number as it is, in either."""
    pct: set[str] = set()
    pt: set[str] = set()
    if isinstance(value, dict):
        for v in value.values():
            p, q = _data_numbers(v)
            pct, pt = pct | p, pt | q
        if isinstance(value.get("sft"), dict) and isinstance(value.get("grpo"), dict):
            sft, grpo = value["sft"].get("greedy"), value["grpo"].get("greedy")
            if isinstance(sft, float) and isinstance(grpo, float):
                pt.add(f"{100 * (grpo - sft):.1f}")
    elif isinstance(value, list):
        for v in value:
            p, q = _data_numbers(v)
            pct, pt = pct | p, pt | q
        if len(value) == 2 and all(isinstance(v, float) and 0 <= v <= 1 for v in value):
            pt.add(f"{100 * (value[1] - value[0]):.1f}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = {f"{value:.1f}", str(value)}
        pct |= shown | ({f"{100 * value:.1f}"} if isinstance(value, float) and 0 <= value <= 1 else set())
        pt |= shown
    return {_plain(n) for n in pct}, {_plain(n) for n in pt}


_CELL = re.compile(rf"({_N})\s?(%|pt\b)?")


def page_parts(page: Path, results: Path = RESULTS) -> tuple[list[tuple[int, str]], set[str], set[str], set[str]]:
    """(prose lines, percents and points the page shows, numbers it lists as not in a table); its data
    files in `results`."""
    text = page.read_text()
    listed = {_plain(n) for block in LISTED.findall(text) for n in CELL_NUMBER.findall(block.split(":")[0])}
    pct: set[str] = set()
    pt: set[str] = set()
    for data in set(MARKER.findall(text)):
        p, q = _data_numbers(json.loads((results / data).read_text())["tables"])
        pct, pt = pct | p, pt | q
    prose, in_code = [], False
    for number, line in enumerate(LISTED.sub("", text).splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif line.startswith("|"):
            for n, unit in _CELL.findall(line):
                if unit != "pt":
                    pct.add(_plain(n))
                if unit != "%":
                    pt.add(_plain(n))
        elif not in_code:
            prose.append((number, re.sub(r"<!--.*?-->|`[^`]*`", "", line)))
    return prose, pct, pt, listed


def unshown_numbers(page: Path, results: Path = RESULTS) -> list[str]:
    """Each number in the page's prose that it neither shows in a table or data file nor lists: a
    percent among the page's percents (a whole one may be one of them rounded), a change in points
    among its points, to the decimal."""
    prose, pct, pt, listed = page_parts(page, results)
    rounded = {f"{float(n):.0f}" for n in pct if "." in n}
    misses = []
    for line_number, line in prose:
        for claim in CLAIM.finditer(line):
            percent = claim.group(4) == "%"
            for number in (claim.group(1), claim.group(3)):
                n = None if number is None else _plain(number)
                if n is None or n in listed:
                    continue
                if (n in pct or ("." not in n and n in rounded)) if percent else n in pt:
                    continue
                misses.append(f"{page.name}:{line_number}: {number}{'%' if percent else ' points'} in {line.strip()[:100]!r}")
    return misses


PAGES = sorted(p for p in RESULTS.glob("*.md") if MARKER.search(p.read_text()))


def test_the_pages_with_data_files_are_checked():
    assert {"demo.md", "async.md", "machine-limit.md"} <= {p.name for p in PAGES}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_number_in_a_results_page_s_prose_is_one_its_tables_show(page):
    misses = unshown_numbers(page)
    assert not misses, ("prose states numbers that no table or data file of the page holds; cite the table, fix "
                        "the number, or list it in <!-- prose numbers not in a table: ...: why -->:\n"
                        + "\n".join(misses))


def test_a_number_that_contradicts_the_table_fails(tmp_path):
    """The sentences this check was written for: a range the table does not give, a stale gain."""
    demo = (RESULTS / "demo.md").read_text()
    page = tmp_path / "demo.md"
    for wrong in ("CoT gains 18–34 points over the rows of this page.", "GRPO still adds 22.5 points.",
                  "π_SFT moves from 45.1% to 58.6%."):
        page.write_text(demo + "\n" + wrong + "\n")
        assert unshown_numbers(page, RESULTS), wrong
