"""The README's demo claim comes from committed run summaries.

- A data-file row that names a `summary` (a summary.json its run wrote, committed under
  docs/results/data/) holds that summary's numbers: held-out accuracies, the change's interval, TIR and
  validation accuracies.
- The README's example row is one of those summaries, as the demo prints it.
- The README's range (median, lowest and highest gain) is computed from the summaries of the runs at
  the demo's preset, and the range of the older, transcribed runs from their rows in data/demo.json.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from test_docs import demo_row, readme_demo_row

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "results" / "data"
README = ROOT / "README.md"
EXAMPLE_RUN = "demo-runs/16k-s0/summary.json"  # the README's one draw


def summary_rows() -> list:
    rows = []
    for data in sorted(DATA.glob("*.json")):
        for name, table in json.loads(data.read_text()).get("tables", {}).items():
            rows += [pytest.param(row, id=f"{data.name}#{name}:{row['summary']}") for row in table["rows"]
                     if "summary" in row]
    return rows


def change(row: dict) -> float:
    return round(100 * (row["grpo"]["greedy"] - row["sft"]["greedy"]), 1)


def test_some_rows_come_from_committed_summaries():
    assert len(summary_rows()) >= 2


@pytest.mark.parametrize("row", summary_rows())
def test_a_row_that_names_its_summary_holds_its_numbers(row):
    summary = json.loads((DATA / row["summary"]).read_text())
    assert "transcribed" not in row
    assert row["sft"] == {"greedy": summary["sft_accuracy"], "maj": summary["sft"]["maj_at_k"],
                          "pass": summary["sft"]["pass_at_k"]}
    assert row["grpo"] == {"greedy": summary["grpo_accuracy"], "maj": summary["grpo"]["maj_at_k"],
                           "pass": summary["grpo"]["pass_at_k"]}
    interval = summary["greedy_change"]
    assert row["interval"] == [round(100 * interval["low"], 1), round(100 * interval["high"], 1)]
    assert row["tir"] == [summary["sft_tir_accuracy"], summary["grpo_tir_accuracy"]]
    assert row["validation"] == [summary["validation"]["before"], summary["validation"]["after"]]
    assert f"--seed {summary['seed']} " in row["command"]


def preset_runs() -> list[dict]:
    """The rows of runs at the demo's preset, from their summaries."""
    rows = json.loads((DATA / "demo.json").read_text())["tables"]["validation"]["rows"]
    return [row for row in rows if row["preset"]]


def readme_claims() -> tuple[str, str]:
    text = " ".join(README.read_text().split())
    current = re.search(r"over the (\d+) runs of this code with committed summaries \(([^)]*)\), the gain's median "
                        r"is \*\*([+-][\d.]+) pt\*\*, from \*\*([+-][\d.]+)\*\* to \*\*([+-][\d.]+) pt\*\*", text)
    older = re.search(r"over the (\d+) recorded runs of the code before the validation split \([^)]*transcribed[^)]*\)"
                      r",? (?:it|the gain) ran from ([+-][\d.]+) to ([+-][\d.]+) pt, median ([+-][\d.]+)", text)
    assert current and older, "README.md's demo sentence is not in the form this test reads"
    return current.groups(), older.groups()


def test_the_readme_range_is_the_preset_runs_summaries():
    (count, _, median, low, high), _ = readme_claims()
    gains = [change(row) for row in preset_runs()]
    assert int(count) == len(gains)
    assert [float(median), float(low), float(high)] == [round(statistics.median(gains), 1), min(gains), max(gains)]


def test_the_readme_range_of_older_runs_is_their_transcribed_rows():
    _, (count, low, high, median) = readme_claims()
    rows = json.loads((DATA / "demo.json").read_text())["tables"]["accuracy"]["rows"]
    assert all(row["transcribed"] for row in rows)
    gains = [change(row) for row in rows]
    assert int(count) == len(gains)
    assert [float(low), float(high), float(median)] == [min(gains), max(gains), round(statistics.median(gains), 1)]


def test_the_readme_row_is_one_committed_summary_as_the_demo_prints_it():
    summary = json.loads((DATA / EXAMPLE_RUN).read_text())
    assert readme_demo_row() == demo_row(summary)
    assert EXAMPLE_RUN.removesuffix("summary.json") in README.read_text()


def test_a_wrong_number_in_the_readme_sentence_fails(monkeypatch, tmp_path):
    text = README.read_text()
    (_, _, median, _, _), _ = readme_claims()
    wrong = tmp_path / "README.md"
    wrong.write_text(re.sub(r"(median is\s+\*\*)" + re.escape(median), rf"\g<1>{float(median) + 0.1:+.1f}", text))
    assert wrong.read_text() != text
    monkeypatch.setattr(sys.modules[__name__], "README", wrong)
    with pytest.raises(AssertionError):
        test_the_readme_range_is_the_preset_runs_summaries()


@pytest.mark.slow
def test_the_demo_gain_on_this_machine_is_within_the_recorded_range(seed0_demo):
    """CI's own `grpokit demo --seed 0` (the slow tier's run, shared with the other demo checks) against the
    range the README states: the lowest and highest gain of every recorded run, committed or transcribed."""
    recorded = [change(row) for row in preset_runs()]
    recorded += [change(row) for row in json.loads((DATA / "demo.json").read_text())["tables"]["accuracy"]["rows"]]
    summary = json.loads((seed0_demo / "summary.json").read_text())
    gain = round(summary["improvement_points"], 1)
    assert min(recorded) <= gain <= max(recorded), (
        f"this machine's seed-0 demo gained {gain:+.1f} points, outside the recorded runs' {min(recorded):+.1f} to "
        f"{max(recorded):+.1f}: commit its summary.json under docs/results/data/demo-runs/ and add its row")
