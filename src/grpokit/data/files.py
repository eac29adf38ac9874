"""Prompt datasets from JSONL, JSON or Parquet files, checked row by row before any model loads.

Each row becomes {"prompt": ..., "answer": ..., **the row's other columns}; the other columns
reach reward functions as keyword arguments, as in TRL. Every problem names the file, the line
(JSONL) or row index (JSON, Parquet) and the column, and says how to fix it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class DatasetError(ValueError):
    """A dataset file that cannot be used as it is."""


@dataclass
class LoadedRows:
    rows: list[dict]
    skipped: list[str] = field(default_factory=list)  # "file:line: why", for each line left out

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def read_file_records(path: str | Path, skip_malformed: bool) -> tuple[list[tuple[str, object]], list[str]]:
    """[(location, record)], [skipped]: location is 'file:line' (JSONL) or 'file[row i]'."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".ndjson"):
        records, skipped = [], []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as err:
                    message = f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})"
                    if not skip_malformed:
                        raise DatasetError(message + "; fix the line, or set data.skip_malformed_lines=true "
                                                     "to skip and count such lines") from None
                    skipped.append(message)
        return records, skipped
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]} as some exports write it
        if not isinstance(data, list):
            raise DatasetError(f"{path}: expected a JSON list of objects (or JSONL, one object a line)")
        return [(f"{path}[row {i}]", r) for i, r in enumerate(data)], []
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow; pip install pyarrow") from None
        table = pq.read_table(path)
        return [(f"{path}[row {i}]", r) for i, r in enumerate(table.to_pylist())], []
    raise DatasetError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")


def load_prompt_rows(
    path: str | Path,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    skip_malformed: bool = False,
) -> LoadedRows:
    """Rows with a non-empty 'prompt' (from prompt_column) and 'answer' (from answer_column).

    Malformed lines, rows that are not objects, missing columns and empty prompts raise
    DatasetError naming the location, or, with skip_malformed, are skipped and listed.
    """
    records, skipped = read_file_records(path, skip_malformed)
    return check_records(records, skipped, str(path), prompt_column, answer_column, skip_malformed)


def read_hub_dataset(name: str, subset: str, split: str) -> list[tuple[str, object]]:
    """[(location, record)] of a Hugging Face `datasets` split (needs the optional extra)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"data source {name!r} is a datasets name, which needs the optional extra: "
                           "pip install 'grpokit[datasets]' (or give a local file as path)") from None
    try:
        table = datasets.load_dataset(name, subset or None, split=split)
    except Exception as err:  # offline, unknown name, bad split: say which and why
        raise DatasetError(f"could not load dataset {name!r} (subset {subset!r}, split {split!r}): {err}") from err
    return [(f"{name}[{split}][row {i}]", r) for i, r in enumerate(table)]


def check_records(records: list[tuple[str, object]], skipped: list[str], source: str, prompt_column: str,
                  answer_column: str | None, skip_malformed: bool) -> LoadedRows:
    """Validate located records into rows: objects, with the columns, with a non-empty prompt."""
    rows = []
    for where, record in records:
        problem = None
        if not isinstance(record, dict):
            problem = f"{where}: expected a JSON object, got {type(record).__name__}"
        else:
            missing = [c for c in (prompt_column, answer_column) if c and c not in record]
            if missing:
                problem = (f"{where}: no column {missing[0]!r} (the row has {sorted(record)}); "
                           f"set data.prompt_column / data.answer_column to the right names")
            elif not isinstance(record[prompt_column], str) or not record[prompt_column].strip():
                problem = f"{where}: column {prompt_column!r} is empty or not text ({record[prompt_column]!r})"
        if problem:
            if not skip_malformed:
                raise DatasetError(problem + "; or set data.skip_malformed_lines=true to skip and count such rows")
            skipped.append(problem)
            continue
        # The raw columns stay as they are: the format decides what the reference is (a MATH row's
        # `answer` field, when it has one, is not its `solution`).
        rows.append({**record, "prompt": record[prompt_column]})
    if not rows:
        raise DatasetError(f"{source}: no usable rows ({len(skipped)} skipped"
                           + (f", first: {skipped[0]}" if skipped else "") + ")")
    return LoadedRows(rows, skipped)


def filter_long_prompts(rows: list[dict], tokenizer, max_prompt_length: int, policy: str,
                        source: str = "dataset") -> tuple[list[dict], int]:
    """Apply data.max_prompt_length (tokens): 'skip' drops and counts long prompts, 'truncate'
    keeps their last max_prompt_length tokens (the question's end and the template's cue),
    'error' refuses the dataset naming the first one. Returns (rows, number affected)."""
    if max_prompt_length <= 0:
        return rows, 0
    kept, affected, first = [], 0, None
    for i, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append(row)
            continue
        affected += 1
        first = first if first is not None else (i, len(ids))
        if policy == "truncate":
            kept.append({**row, "prompt": tokenizer.decode(ids[-max_prompt_length:])})
    if affected and policy == "error":
        i, n = first
        raise DatasetError(f"{source}: {affected} prompts are longer than data.max_prompt_length="
                           f"{max_prompt_length} tokens (first: row {i}, {n} tokens); raise the limit, or set "
                           "data.long_prompts to 'skip' or 'truncate'")
    if not kept:
        raise DatasetError(f"{source}: every prompt is longer than data.max_prompt_length={max_prompt_length}")
    return kept, affected
