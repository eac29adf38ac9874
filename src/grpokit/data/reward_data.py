"""Training data for reward models from JSONL, JSON or Parquet files, checked row by row.

Three kinds of rows: preference pairs (prompt, chosen, rejected) for a pairwise (Bradley-Terry)
reward model, graded samples (prompt, completion, correct) for an outcome reward model, and
step-labelled samples (prompt, steps, labels) for a process reward model. Every problem names
the file, the line (JSONL) or row index (JSON, Parquet) and the field, and says how to fix it.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from grpokit.data.files import TRAINING_FIXES, DatasetError, read_file_records

T = TypeVar("T")

GRADE_FIELDS = ("correct", "label", "reward")


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class GradedSample:
    prompt: str
    completion: str
    correct: bool


@dataclass(frozen=True)
class StepLabelledSample:
    prompt: str
    steps: tuple[str, ...]  # each with its trailing delimiter, except possibly the last
    labels: tuple[bool, ...]  # one per step


class _RowProblem(Exception):
    """One row that cannot be used; the message starts with its location."""


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read_rows(path: str | Path, skip_malformed: bool, parse: Callable[[str, dict], T]) -> list[T]:
    """parse(location, record) for each record; problems raise or, with skip_malformed, are skipped."""
    records, skipped = read_file_records(path, skip_malformed)
    items = []
    for where, record in records:
        try:
            if not isinstance(record, dict):
                raise _RowProblem(f"{where}: expected a JSON object, got {type(record).__name__}")
            items.append(parse(where, record))
        except _RowProblem as problem:
            if not skip_malformed:
                raise DatasetError(f"{problem}; or {TRAINING_FIXES.skip}") from None
            skipped.append(str(problem))
    if not items:
        raise DatasetError(f"{path}: no usable rows ({len(skipped)} skipped"
                           + (f", first: {skipped[0]}" if skipped else "") + ")")
    return items


def _text(where: str, record: dict, name: str, needed: str, allow_empty: bool = False) -> str:
    """record[name] as text; `needed` lists the fields a row needs, for the message."""
    if name not in record:
        raise _RowProblem(f"{where}: no field {name!r} (the row has {sorted(record)}); every row needs {needed}")
    value = record[name]
    if not isinstance(value, str):
        raise _RowProblem(f"{where}: field {name!r} must be text, got {type(value).__name__} "
                          f"({_short(value)}); store it as a string")
    if not allow_empty and not value.strip():
        raise _RowProblem(f"{where}: field {name!r} is empty; give it the text, or drop the row")
    return value


def _is_flag(value: object) -> bool:
    # bool, or an int 0/1 as CSV-born exports write them; not 0.0/1.0, which usually means a score
    return isinstance(value, bool) or (type(value) is int and value in (0, 1))


def read_preference_pairs(path: str | Path, skip_malformed: bool = False) -> list[PreferencePair]:
    """Rows with text in 'prompt' (non-empty), 'chosen' and 'rejected', chosen != rejected. A completion
    may be empty: a policy that stops at once wrote exactly that."""
    needed = "text in 'prompt', 'chosen' and 'rejected'"

    def parse(where: str, record: dict) -> PreferencePair:
        prompt = _text(where, record, "prompt", needed)
        chosen, rejected = (_text(where, record, name, needed, allow_empty=True) for name in ("chosen", "rejected"))
        if chosen == rejected:  # the loss on such a pair is a constant: nothing to learn, likely a bad join
            raise _RowProblem(f"{where}: fields 'chosen' and 'rejected' are the same text; "
                              "fix one of them or drop the row")
        return PreferencePair(prompt, chosen, rejected)

    return _read_rows(path, skip_malformed, parse)


def _grade(where: str, record: dict) -> bool:
    accepted = ("accepted grade fields: 'correct' or 'label' (true/false or 1/0), "
                "or 'reward' (a number, correct when > 0.5)")
    for name in GRADE_FIELDS:
        value = record.get(name)
        if value is None:  # absent, or null as Parquet and JSON exports write a missing value
            continue
        if name == "reward":
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _RowProblem(f"{where}: field 'reward' must be a finite number, got {_short(value)}; {accepted}")
            return value > 0.5
        if not _is_flag(value):
            raise _RowProblem(f"{where}: field {name!r} must be true/false or 1/0, got {_short(value)}; {accepted}")
        return bool(value)
    raise _RowProblem(f"{where}: no grade (the row has {sorted(record)}); {accepted}")


def read_graded_samples(path: str | Path, skip_malformed: bool = False) -> list[GradedSample]:
    """Rows with 'prompt', 'completion' and a grade in 'correct', 'label' or 'reward' (first present wins)."""
    needed = "'prompt', 'completion' and a grade ('correct', 'label' or 'reward')"

    def parse(where: str, record: dict) -> GradedSample:
        prompt = _text(where, record, "prompt", needed)
        # an empty completion is a real sample (the model said nothing) and a fine negative
        completion = _text(where, record, "completion", needed, allow_empty=True)
        return GradedSample(prompt, completion, _grade(where, record))

    return _read_rows(path, skip_malformed, parse)


def pairs_from_graded(samples: list[GradedSample], seed: int = 0, max_pairs_per_prompt: int = 8) -> list[PreferencePair]:
    """Preference pairs (a correct completion over an incorrect one) for each prompt that has both.

    Prompts keep their first-seen order; a prompt with more than max_pairs_per_prompt possible pairs
    gets a sample of them drawn with random.Random(seed), kept in (correct, incorrect) order.
    """
    if max_pairs_per_prompt < 1:
        raise ValueError(f"max_pairs_per_prompt must be at least 1, got {max_pairs_per_prompt}")
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for sample in samples:
        correct, incorrect = groups.setdefault(sample.prompt, ([], []))
        texts = correct if sample.correct else incorrect
        if sample.completion not in texts:  # repeats would only repeat pairs
            texts.append(sample.completion)
    rng = random.Random(seed)
    pairs = []
    for prompt, (correct, incorrect) in groups.items():
        total = len(correct) * len(incorrect)
        if not total:
            continue
        # a text graded both ways pairs with itself once at most; over-draw by that many, then drop them
        same = len(set(correct) & set(incorrect))
        if total - same <= max_pairs_per_prompt:
            cells = range(total)
        else:  # sample cell indices, never the full cross product (it can be large)
            cells = sorted(rng.sample(range(total), max_pairs_per_prompt + same))
        kept = 0
        for cell in cells:
            chosen, rejected = correct[cell // len(incorrect)], incorrect[cell % len(incorrect)]
            if chosen == rejected:
                continue
            pairs.append(PreferencePair(prompt, chosen, rejected))
            kept += 1
            if kept == max_pairs_per_prompt:
                break
    return pairs


def split_steps(text: str, delimiter: str) -> list[str]:
    """`text` split after each `delimiter`: the pieces concatenate back to exactly `text`.

    Every piece but the last ends with the delimiter. A piece with nothing but whitespace before
    its delimiter (a blank line between steps) is no step of its own: it joins the step before it,
    or, at the start of the text, the step after it. No delimiter gives one step; "" gives none.
    """
    if not delimiter:
        raise ValueError("the step delimiter must not be empty")
    parts = text.split(delimiter)
    steps: list[str] = []
    pending = ""  # leading blank pieces, until the first step with content
    for i, part in enumerate(parts):
        piece = part if i == len(parts) - 1 else part + delimiter
        if part.strip():
            steps.append(pending + piece)
            pending = ""
        elif steps:
            steps[-1] += piece
        else:
            pending += piece
    if pending:  # nothing but whitespace and delimiters: still give back all of the text
        steps.append(pending)
    return steps


def _labels(where: str, record: dict) -> list[bool]:
    labels = record.get("labels")
    if "labels" not in record:
        raise _RowProblem(f"{where}: no field 'labels' (the row has {sorted(record)}); "
                          "give a list of true/false or 1/0, one per step")
    if not isinstance(labels, (list, tuple)):
        raise _RowProblem(f"{where}: field 'labels' must be a list of true/false or 1/0, one per step, "
                          f"got {type(labels).__name__}")
    for i, label in enumerate(labels):
        if not _is_flag(label):
            raise _RowProblem(f"{where}: field 'labels' item {i} must be true/false or 1/0, got {_short(label)}")
    return [bool(label) for label in labels]


def read_step_labels(path: str | Path, delimiter: str = "\n", skip_malformed: bool = False) -> list[StepLabelledSample]:
    """Rows with 'prompt', 'labels' and either 'steps' (a list of strings) or 'completion' (text,
    split into steps with split_steps on `delimiter`); one label per step. 'steps' wins if both."""
    if not delimiter:  # before reading the file, not once per row
        raise ValueError("the step delimiter must not be empty")
    needed = "'prompt', 'labels' and 'steps' or 'completion'"

    def parse(where: str, record: dict) -> StepLabelledSample:
        prompt = _text(where, record, "prompt", needed)
        if "steps" in record:
            given = record["steps"]
            if not isinstance(given, (list, tuple)) or not given:
                raise _RowProblem(f"{where}: field 'steps' must be a non-empty list of strings, "
                                  f"got {_short(given)}")
            for i, step in enumerate(given):
                # an empty completion is one empty step; otherwise every step holds text
                if not isinstance(step, str) or (not step.strip() and len(given) > 1):
                    raise _RowProblem(f"{where}: field 'steps' item {i} must be non-empty text, got {_short(step)}")
            # joined as the model would have written them: each step ends where the next begins
            steps = [s if i == len(given) - 1 or s.endswith(delimiter) else s + delimiter
                     for i, s in enumerate(given)]
            split_note = ""
        elif "completion" in record:
            completion = _text(where, record, "completion", needed, allow_empty=True)
            steps = split_steps(completion, delimiter) or [completion]  # no delimiter (or empty): one step
            split_note = f" (split on {delimiter!r})"
        else:
            raise _RowProblem(f"{where}: no field 'steps' (a list of strings) or 'completion' (text split "
                              f"on {delimiter!r}) (the row has {sorted(record)})")
        labels = _labels(where, record)
        if len(labels) != len(steps):
            raise _RowProblem(f"{where}: {len(labels)} labels for {len(steps)} steps{split_note}; "
                              "give one label per step" + (", or the delimiter the completion uses"
                                                           if split_note else ""))
        return StepLabelledSample(prompt, tuple(steps), tuple(labels))

    return _read_rows(path, skip_malformed, parse)


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """One JSON object a line, replacing `path` atomically: readers see the old file or the new one."""
    path = Path(path)
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise TypeError(f"record {i} is a {type(record).__name__}, not a dict")
    # serialise first, so that a value JSON cannot hold fails before any file is touched
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")  # same dir: os.replace stays a rename
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 less the umask, as open() gives
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
