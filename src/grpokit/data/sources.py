"""Dataset sources -> rows the trainers use. A source is a file or a `datasets` name plus a
format that says where the question and the reference answer live:

  gsm8k  question, answer ("... #### 72")      -> reference "72"
  math   problem, solution ("... \\boxed{x}"), optional answer -> the answer field, else the last boxed
  plain  prompt_column, answer_column as given

RL rows: {"prompt": rendered prompt, "answer": reference (None for prompt-only rows, which the
user's rewards score), **the source's columns}; a conversational prompt (TRL's list of
{"role", "content"} messages) is rendered with the chat template and kept as the row's
"prompt_messages", which reward functions receive as their `prompts`.
SFT rows: {"prompt": rendered prompt, "completion": the worked solution}.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from grpokit.data.answers import gsm8k_reference, math_reference
from grpokit.data.files import (
    TRAINING_FIXES,
    DatasetError,
    Fixes,
    LoadedRows,
    check_records,
    is_conversation,
    read_file_records,
    read_hub_dataset,
)
from grpokit.data.templates import MESSAGES, last_user_text, render_messages, render_prompt

FORMAT_COLUMNS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"), "plain": ("prompt", "answer")}
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def detect_format(record: dict) -> str:
    if "question" in record and "####" in str(record.get("answer", "")):
        return "gsm8k"
    if "problem" in record and "solution" in record:
        return "math"
    return "plain"


def load_source(source, skip_malformed: bool = False, read_reference: Callable[[dict, str, str], str] | None = None,
                fixes: Fixes = TRAINING_FIXES, needs_answer: bool = True) -> tuple[LoadedRows, str]:
    """(rows with the raw columns checked, and their reference answers; resolved format) of one
    DataSource config. read_reference(row, format, answer column) reads a row's reference
    (default: reference_answer); a row it cannot read is malformed like any other. Without
    `needs_answer` (the run's rewards are the user's own), plain rows may come without an answer
    column: their reference is None."""
    if bool(source.path) == bool(source.name):
        raise DatasetError("each data source needs exactly one of path (a local file) or name (a datasets name)")
    if source.path:
        records, skipped = read_file_records(source.path, skip_malformed, fixes)
        where = source.path
    else:
        records, skipped, where = read_hub_dataset(source.name, source.subset, source.split), [], source.name
    if source.max_rows > 0:
        records = records[: source.max_rows]
    first = next((r for _, r in records if isinstance(r, dict)), {})
    fmt = detect_format(first) if source.format == "auto" else source.format
    default_prompt, default_answer = FORMAT_COLUMNS[fmt]
    prompt_column = source.prompt_column or default_prompt
    answer_column = source.answer_column or default_answer
    if not needs_answer and fmt == "plain" and not source.answer_column and answer_column not in first:
        answer_column = None  # prompt-only rows: the user's rewards read what they need
    read = read_reference or reference_answer
    loaded = check_records(records, skipped, where, prompt_column, answer_column, skip_malformed,
                           lambda row: read(row, fmt, answer_column) if answer_column else None, fixes)
    for row in loaded.rows:
        row["question"] = row["prompt"]  # the raw question, before any template
    return loaded, fmt


def reference_answer(row: dict, fmt: str, answer_column: str) -> str:
    """A row's reference answer; ValueError saying why when it has none that can be read."""
    if fmt == "plain":
        return str(row[answer_column])
    if fmt == "gsm8k":
        return gsm8k_reference(str(row[answer_column]))
    return math_reference(str(row["solution"]), row.get("answer"))


def worked_solution(row: dict, fmt: str, completion_column: str) -> str:
    """The SFT target: GSM8K's solution without calculator annotations, ending in a boxed answer."""
    if fmt == "gsm8k":
        body, _, final = str(row["answer"]).rpartition("####")
        return _CALCULATOR.sub("", body).strip() + f"\nThe final answer is $\\boxed{{{final.strip()}}}$."
    if fmt == "math":
        return str(row["solution"])
    return str(row[completion_column])


def say_skipped(loaded: LoadedRows, where: str) -> None:
    """The first few skipped rows and why, then how many were skipped, on stderr."""
    for line in loaded.skipped[:5]:
        print(f"grpokit: skipped {line}", file=sys.stderr)
    if loaded.num_skipped:
        print(f"grpokit: skipped {loaded.num_skipped} malformed rows of {where}", file=sys.stderr)


def build_rows(sources, data_config, tokenizer, sft: bool = False) -> list[dict]:
    """All sources' rows, prompts rendered with the template (a conversational prompt, with the
    tokenizer's chat template alone, as TRL does); problems reported on stderr. Whether rows need
    an answer was checked before (check_sources); one without has the answer None."""
    out = []
    for source in sources:
        loaded, fmt = load_source(source, data_config.skip_malformed_lines, needs_answer=sft)
        say_skipped(loaded, source.path or source.name)
        for i, (row, reference) in enumerate(zip(loaded.rows, loaded.references, strict=True)):
            if is_conversation(row["prompt"]):
                messages = row["prompt"]
                prompt = render_messages(messages, tokenizer, f"{source.path or source.name} row {i}")
                row = {**row, MESSAGES: messages, "question": last_user_text(messages)}
            else:
                prompt = render_prompt(row["question"], tokenizer, data_config.template, data_config.chat_template,
                                       data_config.system_prompt, data_config.plain_layout)
            if sft:
                out.append({"prompt": prompt, "completion": worked_solution(row, fmt, source.completion_column)})
            else:
                out.append({**row, "prompt": prompt, "answer": reference})
    return out


def check_sources(sources, skip_malformed: bool, needs_answer: bool = True) -> None:
    """Read and validate every source (no tokenizer needed): run before any model loads.
    `needs_answer`: rows must carry a reference answer (the task's own reward grades against it)."""
    for source in sources:
        load_source(source, skip_malformed, needs_answer=needs_answer)


def long_prompts_note(affected: int, total: int, what: str, data_config) -> str:
    """One line: how many of how many `what` are over data.max_prompt_length, and what became of them."""
    limit = data_config.max_prompt_length
    over = f"grpokit: {affected} of {total} {what} are over data.max_prompt_length={limit} tokens"
    if data_config.long_prompts == "truncate":
        return f"{over} and were cut to their last {limit} tokens (data.long_prompts=truncate)"
    return f"{over} and were dropped (data.long_prompts=skip); raise data.max_prompt_length to keep them"


def heldout_note(total: int, dropped: int, data_config) -> str | None:
    """The line saying which held-out questions data.max_prompt_length dropped (evaluation never
    cuts one), or the true reason there are none; None when every one is kept."""
    d, no_evaluation = data_config, "training without evaluation"
    never_cut = "were dropped (evaluation never truncates a question)"
    if total and dropped == total:
        return (f"grpokit: no held-out questions: all {total} are over data.max_prompt_length={d.max_prompt_length} "
                f"tokens and {never_cut}; raise data.max_prompt_length to evaluate them; {no_evaluation}")
    if dropped:
        return (f"grpokit: {dropped} of {total} held-out questions are over data.max_prompt_length="
                f"{d.max_prompt_length} tokens and {never_cut}; raise data.max_prompt_length to keep them")
    if total:
        return None
    if d.sources and not d.eval_sources and d.heldout_fraction > 0:
        return (f"grpokit: no held-out questions: data.heldout_fraction={d.heldout_fraction:g} of data.sources "
                f"picked none (too few questions); set data.eval_sources or raise data.heldout_fraction; "
                f"{no_evaluation}")
    return ("grpokit: no held-out questions (none configured: set data.eval_sources or data.heldout_fraction); "
            + no_evaluation)
