"""Dataset sources -> rows the trainers use. A source is a file or a `datasets` name plus a
format that says where the question and the reference answer live:

  gsm8k  question, answer ("... #### 72")      -> reference "72"
  math   problem, solution ("... \\boxed{x}"), optional answer -> the answer field, else the last boxed
  plain  prompt_column, answer_column as given

RL rows: {"prompt": rendered prompt, "answer": reference, **the source's columns}.
SFT rows: {"prompt": rendered prompt, "completion": the worked solution}.
"""

from __future__ import annotations

import re
import sys

from grpokit.data.files import (
    DatasetError,
    LoadedRows,
    check_records,
    read_file_records,
    read_hub_dataset,
)
from grpokit.data.templates import render_prompt

FORMAT_COLUMNS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution"), "plain": ("prompt", "answer")}
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def detect_format(record: dict) -> str:
    if "question" in record and "####" in str(record.get("answer", "")):
        return "gsm8k"
    if "problem" in record and "solution" in record:
        return "math"
    return "plain"


def load_source(source, skip_malformed: bool = False) -> tuple[LoadedRows, str]:
    """(rows with the raw columns checked, resolved format) of one DataSource config."""
    if bool(source.path) == bool(source.name):
        raise DatasetError("each data source needs exactly one of path (a local file) or name (a datasets name)")
    if source.path:
        records, skipped = read_file_records(source.path, skip_malformed)
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
    loaded = check_records(records, skipped, where, prompt_column, answer_column, skip_malformed)
    for row in loaded.rows:
        row["question"] = row["prompt"]  # the raw question, before any template
    return loaded, fmt


def reference_answer(row: dict, fmt: str, answer_column: str) -> str:
    if fmt == "plain":
        return str(row[answer_column])
    from grpokit.rewards.answers import gsm8k_reference, math_reference

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


def build_rows(sources, data_config, tokenizer, sft: bool = False) -> list[dict]:
    """All sources' rows, prompts rendered with the template; problems reported on stderr."""
    out = []
    for source in sources:
        loaded, fmt = load_source(source, data_config.skip_malformed_lines)
        for line in loaded.skipped[:5]:
            print(f"grpokit: skipped {line}", file=sys.stderr)
        if loaded.num_skipped:
            print(f"grpokit: skipped {loaded.num_skipped} malformed rows of {source.path or source.name}",
                  file=sys.stderr)
        answer_column = source.answer_column or FORMAT_COLUMNS[fmt][1]
        for row in loaded.rows:
            prompt = render_prompt(row["question"], tokenizer, data_config.template, data_config.chat_template,
                                   data_config.system_prompt)
            if sft:
                out.append({"prompt": prompt, "completion": worked_solution(row, fmt, source.completion_column)})
            else:
                out.append({**row, "prompt": prompt, "answer": reference_answer(row, fmt, answer_column)})
    return out


def check_sources(sources, skip_malformed: bool) -> None:
    """Read and validate every source (no tokenizer needed): run before any model loads."""
    for source in sources:
        load_source(source, skip_malformed)
