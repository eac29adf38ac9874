"""`grpokit eval`'s question files: the questions and reference answers of one data file (GSM8K,
MATH or plain question/answer columns), read and checked as training reads its sources; and a
training run's own held-out questions (heldout.jsonl), written for `grpokit eval RUN_DIR`."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpokit.config import DataSource
from grpokit.data.files import DatasetError, Fixes, read_file_records
from grpokit.data.sources import FORMAT_COLUMNS, detect_format, load_source, reference_answer, say_skipped
from grpokit.errors import EvalError
from grpokit.data.answers import final_answers

# Where a question and its reference live when the file is neither GSM8K- nor MATH-shaped.
QUESTION_COLUMNS = ("question", "problem", "prompt")


ANSWER_COLUMNS = ("answer", "solution", "ground_truth")


# File names that say nothing about the benchmark ("test.jsonl"): such a file is named after its folder.
GENERIC_STEMS = {"test", "train", "dev", "val", "valid", "validation", "eval", "data", "questions"}


HELDOUT = "heldout.jsonl"  # a training run's held-out questions (question, answer, the task's columns)


# A bad row's fixes, in grpokit eval's flags.
EVAL_FIXES = Fixes(skip="pass --skip-malformed-lines to skip and count such rows",
                   columns="name the columns with --question-column and --answer-column")


@dataclass
class Benchmark:
    """The questions of one data file and their reference answers, in file order."""

    name: str
    path: str
    format: str
    question_column: str
    answer_column: str
    questions: list[str]
    references: list[str]
    rows: list[dict] = field(default_factory=list, repr=False)  # each row's columns, "answer" its reference

    def row(self, i: int) -> dict:
        return {**(self.rows[i] if self.rows else {}), "question": self.questions[i], "answer": self.references[i]}

    def __len__(self) -> int:
        return len(self.questions)


def _split_spec(spec: str) -> tuple[str | None, str]:
    """"NAME=FILE" -> (NAME, FILE); a plain FILE (even one holding "=") -> (None, FILE)."""
    name, sep, path = spec.partition("=")
    if sep and name and re.fullmatch(r"[\w.-]+", name) and not Path(spec).exists():
        return name, path
    return None, spec


def dataset_name(path: str) -> str:
    """The file's stem, or its folder's name when the stem is generic (gsm8k/test.jsonl -> gsm8k)."""
    p = Path(path)
    stem = p.name.split(".")[0]
    if stem.lower() in GENERIC_STEMS and p.resolve().parent.name:
        stem = p.resolve().parent.name
    return re.sub(r"[^\w.-]+", "-", stem).strip("-") or "data"


def _reference(row: dict, fmt: str, answer_column: str) -> str:
    """The reference answer: GSM8K's "#### x", MATH's answer field or last box, else the
    column itself, or the final answer it states when it is a worked solution ("A: 64")."""
    if fmt != "plain":
        reference = reference_answer(row, fmt, answer_column)
    else:
        text = str(row[answer_column]).strip()
        stated = final_answers(text)
        reference = stated[-1] if stated else text
    if not reference.strip():
        raise ValueError(f"the reference answer (column {answer_column!r}) is empty")
    return reference.strip()


def load_benchmark(spec: str, max_rows: int = 0, question_column: str = "", answer_column: str = "",
                   skip_malformed: bool = False) -> Benchmark:
    """Questions and references of the file `spec` ("FILE" or "NAME=FILE").

    Columns: GSM8K files (question, answer with "#### x") and MATH files (problem, solution,
    optional answer) are recognised; otherwise the first of question/problem/prompt holds the
    question and the first of answer/solution/ground_truth the reference. Columns named by the
    caller are read as plain text (the reference is the column, or the answer it states).
    Rows are read and checked as training reads them (data.sources.load_source): a bad row, or
    one whose reference cannot be read, is an error naming its line, or with `skip_malformed`
    is left out and counted on stderr.
    """
    name, path = _split_spec(spec)
    records, _ = read_file_records(path, skip_malformed=True)  # the first row decides the columns
    first = next((r for _, r in records if isinstance(r, dict)), None)
    if first is None:
        raise DatasetError(f"{path}: no JSON objects to evaluate")
    fmt = "plain" if (question_column or answer_column) else detect_format(first)
    if fmt == "plain":
        question = question_column or next((c for c in QUESTION_COLUMNS if c in first), "")
        answer = answer_column or next((c for c in ANSWER_COLUMNS if c in first), "")
    else:
        question, answer = FORMAT_COLUMNS[fmt]
    for what, column, looked_for in (("question", question, QUESTION_COLUMNS), ("answer", answer, ANSWER_COLUMNS)):
        if not column or column not in first:
            wanted = repr(column) if column else f"one of {', '.join(looked_for)}"
            raise DatasetError(f"{path}: no {what} column ({wanted}); its rows have the columns {sorted(first)}. "
                               f"Name the columns with --question-column and --answer-column")
    source = DataSource(path=path, format=fmt, prompt_column=question, answer_column=answer, max_rows=max_rows)
    loaded, fmt = load_source(source, skip_malformed, read_reference=_reference, fixes=EVAL_FIXES)
    say_skipped(loaded, path)
    return Benchmark(name or dataset_name(path), path, fmt, question, answer,
                     [row["question"] for row in loaded.rows], loaded.references, loaded.rows)


def load_benchmarks(specs: Sequence[str], max_rows: int = 0, question_column: str = "",
                    answer_column: str = "", skip_malformed: bool = False) -> list[Benchmark]:
    benchmarks = [load_benchmark(s, max_rows, question_column, answer_column, skip_malformed) for s in specs]
    names = Counter(b.name for b in benchmarks)
    clash = [n for n, c in names.items() if c > 1]
    if clash:
        raise EvalError(f"several data files are named {clash[0]!r}; name each with --data NAME=FILE")
    return benchmarks


def write_heldout(run_dir: str | Path, rows: list[dict]) -> Path:
    """A training run's held-out questions, for `grpokit eval RUN_DIR`: each row's columns (its
    reference as "answer", the prompt training rendered as "rendered_prompt"), without the
    worked solution."""
    path = Path(run_dir) / HELDOUT
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            record = {k: v for k, v in row.items() if k not in ("prompt", "solution")}
            record.setdefault("question", row["prompt"])
            f.write(json.dumps({**record, "rendered_prompt": row["prompt"]}, ensure_ascii=False, default=str) + "\n")
    return path
