"""Prompt datasets from JSONL, JSON or Parquet files, checked row by row before any model loads.

Each row becomes {"prompt": ..., "answer": ..., **the row's other columns}; the other columns
reach reward functions as keyword arguments, as in TRL. A prompt is text, or TRL's conversational
format: a list of {"role", "content"} messages. Every problem names the file, the line
(JSONL) or row index (JSON, Parquet) and the column, and says how to fix it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class DatasetError(ValueError):
    """A dataset file that cannot be used as it is."""


@dataclass(frozen=True)
class Fixes:
    """How a command spells the fixes for a bad row: training's config keys, or eval's flags."""

    skip: str = "set data.skip_malformed_lines=true to skip and count such rows"
    columns: str = ("set prompt_column / answer_column on that entry of data.sources (or data.eval_sources, "
                    "data.sft_sources), e.g. --data.sources='[{path: train.jsonl, prompt_column: question, "
                    "answer_column: answer}]'")


TRAINING_FIXES = Fixes()
# The first bytes of binary files people pass by mistake, and what to do instead.
_BINARY_KINDS = {b"PAR1": "it is a Parquet file: give it the .parquet suffix",
                 b"\x1f\x8b": "it is gzip-compressed: gunzip it first"}


@dataclass
class LoadedRows:
    rows: list[dict]
    skipped: list[str] = field(default_factory=list)  # "file:line: why", for each line left out
    references: list[str] = field(default_factory=list)  # each row's reference answer, when asked for

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def not_utf8_error(path: Path, err: UnicodeDecodeError, line: int, line_offset: int = 0) -> DatasetError:
    """The error for a file that is not UTF-8 text: where (line, byte) and what to do instead."""
    with path.open("rb") as f:
        head = f.read(4)
    kind = next((why for magic, why in _BINARY_KINDS.items() if head.startswith(magic)), None)
    fix = kind or "convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8 IN > OUT)"
    return DatasetError(f"{path}:{line}: not UTF-8 text (byte {line_offset + err.start} is "
                        f"{err.object[err.start]:#04x}); {fix}, or pass a JSONL, JSON or Parquet file")


def _read_jsonl(path: Path, skip_malformed: bool, fixes: Fixes) -> tuple[list[tuple[str, object]], list[str]]:
    records, skipped, offset = [], [], 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:  # a file-wide problem (its encoding): never skipped
                raise not_utf8_error(path, err, number, offset) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as err:
                message = f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})"
                if not skip_malformed:
                    raise DatasetError(f"{message}; fix the line, or {fixes.skip}") from None
                skipped.append(message)
    return records, skipped


def _read_json(path: Path) -> list[tuple[str, object]]:
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise not_utf8_error(path, err, raw[: err.start].count(b"\n") + 1) from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} as some exports write it
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of objects (or JSONL, one object a line)")
    return [(f"{path}[row {i}]", r) for i, r in enumerate(data)]


def _read_parquet(path: Path) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow; pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]}); pass a Parquet, "
                           "JSONL or JSON file") from None
    return [(f"{path}[row {i}]", r) for i, r in enumerate(table.to_pylist())]


def read_file_records(path: str | Path, skip_malformed: bool,
                      fixes: Fixes = TRAINING_FIXES) -> tuple[list[tuple[str, object]], list[str]]:
    """[(location, record)], [skipped]: location is 'file:line' (JSONL) or 'file[row i]'."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path, skip_malformed, fixes)
    if suffix == ".json":
        return _read_json(path), []
    if suffix == ".parquet":
        return _read_parquet(path), []
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


def _record_problem(where: str, record: object, prompt_column: str, answer_column: str | None,
                    fixes: Fixes) -> str | None:
    """What keeps a record from being a row (not an object, a missing column, an empty prompt), or None."""
    if not isinstance(record, dict):
        return f"{where}: expected a JSON object, got {type(record).__name__}"
    missing = [c for c in (prompt_column, answer_column) if c and c not in record]
    if missing:
        return f"{where}: no column {missing[0]!r} (the row has {sorted(record)}); {fixes.columns}"
    if isinstance(record[prompt_column], list):  # TRL's conversational format
        return message_problem(where, prompt_column, record[prompt_column])
    if not isinstance(record[prompt_column], str) or not record[prompt_column].strip():
        return f"{where}: column {prompt_column!r} is empty or not text ({record[prompt_column]!r})"
    return None


def is_conversation(prompt) -> bool:
    """A prompt in TRL's conversational format: a list of {"role", "content"} messages."""
    return isinstance(prompt, list)


def message_problem(where: str, column: str, messages: list) -> str | None:
    """What keeps a conversational prompt from being one (no messages, a message without a text
    `role` or `content`), naming the row and the field; None when it is one."""
    if not messages:
        return f"{where}: column {column!r} is an empty list of messages; give at least one {{'role', 'content'}} message"
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            return (f"{where}: {column}[{j}] is a {type(message).__name__}, not a message: give "
                    f"{{'role': ..., 'content': ...}}")
        for field_ in ("role", "content"):
            if not isinstance(message.get(field_), str):
                return (f"{where}: {column}[{j}] has no text {field_!r} (its keys: {', '.join(map(str, message)) or 'none'}); "
                        "each message needs a 'role' and a 'content'")
    return None


def check_records(records: list[tuple[str, object]], skipped: list[str], source: str, prompt_column: str,
                  answer_column: str | None, skip_malformed: bool,
                  read_reference: Callable[[dict], str] | None = None, fixes: Fixes = TRAINING_FIXES) -> LoadedRows:
    """Validate located records into rows: objects, with the columns, with a non-empty prompt,
    and with a reference answer read_reference can read (it raises ValueError saying why not)."""
    rows, references = [], []
    for where, record in records:
        problem = _record_problem(where, record, prompt_column, answer_column, fixes)
        if problem is None and read_reference is not None:
            try:
                references.append(read_reference(record))
            except ValueError as err:
                problem = f"{where}: {err}"
        if problem:
            if not skip_malformed:
                raise DatasetError(f"{problem}; or {fixes.skip}")
            skipped.append(problem)
            continue
        # The raw columns stay as they are: the format decides what the reference is (a MATH row's
        # `answer` field, when it has one, is not its `solution`).
        rows.append({**record, "prompt": record[prompt_column]})
    if not rows:
        raise DatasetError(f"{source}: no usable rows ({len(skipped)} skipped"
                           + (f", first: {skipped[0]}" if skipped else "") + ")")
    return LoadedRows(rows, skipped, references)


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
        raise DatasetError(f"{source}: all {len(rows)} prompts are longer than data.max_prompt_length="
                           f"{max_prompt_length} tokens; raise data.max_prompt_length")
    return kept, affected
