"""`grpokit eval`'s numbers and tables: accuracy, maj@k and pass@k of one dataset x mode; the
report of a results.json; the before/after comparison of two evaluations."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from grpokit.data.templates import PLAIN_LAYOUTS
from grpokit.eval.evaluate import sample_scores
from grpokit.eval.paired import PairedChange, paired_change
from grpokit.eval.records import COMPARE, completions_path, read_results

MODES = ("cot", "tir")
MODE_TITLES = {"cot": "CoT", "tir": "TIR"}
PLAIN_LAYOUT = PLAIN_LAYOUTS["user-assistant"]  # a model's layout without a chat template and without a run's settings


def describe_prompt_format(layout: str, prompt_layout: str | None = None) -> str:
    """How the prompts were laid out: the chat template, DeepSeekMath's plain layout, or (for a
    run's checkpoint without a chat template) its task's own prompts, as results.json records."""
    if layout == "plain" and prompt_layout and prompt_layout != PLAIN_LAYOUT:
        return prompt_layout
    return f"plain {json.dumps(PLAIN_LAYOUT)}" if layout == "plain" else layout


def metrics(records: list[dict], k: int) -> dict:
    """Accuracy and counts of one dataset x mode; maj@k and pass@k when samples were drawn."""
    n = len(records)
    correct = sum(bool(r["correct"]) for r in records)
    out = {"accuracy": correct / n if n else 0.0, "correct": correct, "total": n,
           "with_answer": sum(r["extracted_answer"] is not None for r in records),
           "tool_calls": sum(r.get("tool_calls", 0) for r in records),
           "stop_reasons": dict(Counter(r.get("stop_reason", "answer") for r in records))}
    if k and n:
        majority = passes = 0.0
        for r in records:
            passed, majority_right = sample_scores([s["extracted_answer"] for s in r["samples"]],
                                                   [bool(s["correct"]) for s in r["samples"]], k)
            passes += passed
            majority += majority_right
        out[f"maj@{k}"] = majority / n
        out[f"pass@{k}"] = passes / n
    return out


def _columns(results: dict) -> list[tuple[str, str]]:
    return [(d, m) for d, modes in results.get("results", {}).items() for m in MODES if m in modes]


def _title(column: tuple[str, str]) -> str:
    return f"{column[0]} {MODE_TITLES.get(column[1], column[1])}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def report_markdown(results: dict) -> str:
    """Accuracy per dataset x mode (Table 5's layout), then counts and time per cell."""
    columns = _columns(results)
    cells = results.get("results", {})
    settings = results.get("settings", {})
    k = settings.get("k", 0)
    rows = [[results["model"], *(_percent(cells[d][m]["accuracy"]) for d, m in columns)]]
    for key in (f"maj@{k}", f"pass@{k}") if k else ():
        rows.append([key, *(_percent(cells[d][m].get(key)) for d, m in columns)])
    about = [f"engine {results['engine']}", f"prompts: {describe_prompt_format(results['prompt_format'], results.get('prompt_layout'))}"]
    if settings.get("max_new_tokens") is not None:
        about.append(f"max_new_tokens {settings['max_new_tokens']}, max_tool_calls {settings['max_tool_calls']}")
    if k:
        about.append(f"maj@{k} and pass@{k} from {k} samples at temperature {settings['temperature']}")
    if results.get("sandbox_isolated") is not None:
        isolated = "isolated" if results["sandbox_isolated"] else "NOT isolated"
        about.append(f"TIR programs {isolated} (network, filesystem, processes)")
    details = [[d, MODE_TITLES.get(m, m), *(str(cells[d][m][key]) for key in ("correct", "total", "with_answer",
                                                                               "tool_calls")),
                *(f"{cells[d][m].get(key, 0.0):.1f}" for key in ("seconds", "generate_seconds", "tool_seconds",
                                                                 "score_seconds"))]
               for d, m in columns]
    return "\n".join([
        f"# Evaluation of {results['model']}\n",
        "Greedy accuracy (%); " + "; ".join(about) + ".\n",
        markdown_table(["model", *map(_title, columns)], rows),
        markdown_table(["dataset", "mode", "correct", "total", "with an answer", "tool calls", "seconds",
                        "generating", "running programs", "grading"], details),
    ])


def compare_markdown(before: dict, after: dict, before_label: str, after_label: str,
                     intervals: dict[tuple[str, str], PairedChange] | None = None) -> str:
    """Table 5's shape: one row per model, a column per dataset x mode, then the change in points, and,
    where both evaluations graded the same questions (`intervals`), the change's 95% interval."""
    columns = _columns(before) + [c for c in _columns(after) if c not in _columns(before)]

    def accuracy(results, column):
        cell = results.get("results", {}).get(column[0], {}).get(column[1])
        return None if cell is None else cell["accuracy"]

    change = []
    for column in columns:
        a, b = accuracy(before, column), accuracy(after, column)
        change.append("-" if a is None or b is None else f"{100 * (b - a):+.1f}")
    rows = [[before_label, *(_percent(accuracy(before, c)) for c in columns)],
            [after_label, *(_percent(accuracy(after, c)) for c in columns)],
            ["change", *change]]
    note = ""
    if intervals:
        rows.append(["95% interval", *(f"[{100 * i.low:+.1f}, {100 * i.high:+.1f}]" if (i := intervals.get(c))
                                        else "-" for c in columns)])
        note = " The interval is over the questions both graded, paired (grpokit/eval/paired.py)."
    return (f"Greedy accuracy (%) before and after; change in percentage points.{note}\n\n"
            + markdown_table(["model", *map(_title, columns)], rows))


def paired_intervals(before_dir: str | Path, after_dir: str | Path, columns: list[tuple[str, str]]
                     ) -> dict[tuple[str, str], PairedChange]:
    """For each dataset x mode both directories hold completions of, the greedy change over the questions
    both graded (same index, same question), with its 95% interval."""
    out = {}
    results = [read_results(d) for d in (before_dir, after_dir)]
    for dataset, mode in columns:
        # the rows each results.json counts: a file may hold more, from a run with a larger --max-rows
        totals = [r["results"][dataset][mode]["total"] for r in results]
        records = [{key: ok for key, ok in _graded(completions_path(Path(d), dataset, mode)).items() if key[0] < total}
                   for d, total in zip((before_dir, after_dir), totals)]
        shared = sorted(set(records[0]) & set(records[1]))
        if shared:
            out[(dataset, mode)] = paired_change([records[0][q] for q in shared], [records[1][q] for q in shared])
    return out


def _graded(path: Path) -> dict[tuple[int, str], bool]:
    """(index, question) -> the greedy completion's verdict, from a completions file (empty if none)."""
    if not path.is_file():
        return {}
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {(r["index"], r["question"]): bool(r["correct"]) for r in records}


def compare_runs(before_dir: str, after_dir: str, output_dir: str | None = None) -> tuple[str, Path]:
    """The comparison table of two evaluation directories, written to compare.md."""
    before, after = read_results(before_dir), read_results(after_dir)
    labels = [before.get("model", before_dir), after.get("model", after_dir)]
    if labels[0] == labels[1]:
        labels = [str(before_dir), str(after_dir)]
    intervals = paired_intervals(before_dir, after_dir, [c for c in _columns(before) if c in _columns(after)])
    table = compare_markdown(before, after, *labels, intervals)
    target = Path(output_dir or after_dir)
    target.mkdir(parents=True, exist_ok=True)
    (target / COMPARE).write_text(table)
    return table, target / COMPARE
