"""`grpokit eval`'s files: the completions files a rerun resumes from, results.json, the output
directory, and a training run's graded held-out completions."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from grpokit.errors import EvalError
from grpokit.eval.questions import Benchmark

RESULTS, REPORT, COMPARE = "results.json", "report.md", "compare.md"
# Settings that must match for a rerun to append to an earlier run's completions.
RESUME_KEYS = ("model_path", "prompt_format", "task", "max_new_tokens", "max_tool_calls", "k", "temperature", "seed")


def completions_path(out_dir: Path, dataset: str, mode: str) -> Path:
    return out_dir / f"completions-{dataset}-{mode}.jsonl"


def read_completions(path: Path, bench: Benchmark) -> dict[int, dict]:
    """Records already written to `path`, by question index. A last line cut short by a crash
    is dropped from the file; a record whose question differs from the data is an error."""
    if not path.is_file():
        return {}
    done: dict[int, dict] = {}
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    offset = 0
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the unterminated last line of an interrupted write
                    print(f"grpokit: dropping the incomplete last line of {path}", file=sys.stderr)
                    with path.open("r+b") as f:
                        f.truncate(offset)
                    break
                raise EvalError(f"{path}:{number}: not valid JSON; delete the file to evaluate its dataset again")
            i = record.get("index")
            if isinstance(i, int) and i >= len(bench):
                offset += len(line) + 1
                continue  # a row past this run's --max-rows: kept in the file, left out of the results
            if not isinstance(i, int) or record.get("question") != bench.questions[i]:
                raise EvalError(f"{path}:{number}: written for other data than {bench.path} (question {i} differs); "
                                "use another --output-dir, or delete the file")
            done[i] = record
        offset += len(line) + 1
    return done


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_results(directory: str | Path) -> dict:
    path = Path(directory) / RESULTS
    if not path.is_file():
        raise EvalError(f"{path} does not exist; run `grpokit eval MODEL --data ... --output-dir {directory}` first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise EvalError(f"{path} is not valid JSON ({err.msg}); rerun the evaluation") from None


class ResultsFile:
    """DIR/results.json, rewritten after every dataset x mode; a rerun keeps earlier cells."""

    def __init__(self, out_dir: Path, header: dict):
        self.path = out_dir / RESULTS
        self.data = {**header, "results": {}}
        if self.path.is_file():
            old = json.loads(self.path.read_text())
            changed = [key for key in RESUME_KEYS if old.get("settings", {}).get(key) != header["settings"].get(key)]
            if changed and any(out_dir.glob("completions-*.jsonl")):
                details = ", ".join(f"{key} {old.get('settings', {}).get(key)!r} -> {header['settings'].get(key)!r}"
                                    for key in changed)
                raise EvalError(f"{out_dir} holds an evaluation with other settings ({details}); "
                                "use another --output-dir, or delete that one")
            self.data["results"] = old.get("results", {})

    def cell(self, dataset: str, mode: str) -> dict:
        return self.data["results"].get(dataset, {}).get(mode, {})

    def update(self, dataset: str, mode: str, cell: dict) -> None:
        self.data["results"].setdefault(dataset, {})[mode] = cell
        self.save()

    def save(self) -> None:
        _write_json(self.path, self.data)


def writable_output_dir(path: str) -> Path:
    """`path`, created, once a file could be made in it: an unwritable one fails before any model loads."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as err:
        raise EvalError(f"cannot write to the output directory {out}: {err.strerror or err}; "
                        "pick a writable --output-dir") from None
    return out


def write_heldout_completions(path: str | Path, rows: list[dict], completions: list[str], verdicts: list[bool]) -> Path:
    """A run's greedy held-out completions (an EvalResult's, or its TIRResult's), graded: question,
    answer, completion, correct."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for row, completion, correct in zip(rows, completions, verdicts, strict=True):
            record = {"question": row.get("question", row["prompt"]), "answer": row.get("answer"),
                      "completion": completion, "correct": correct}
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return path
