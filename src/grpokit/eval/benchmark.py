"""`grpokit eval`: a model's accuracy on math benchmarks with chain-of-thought (CoT) and
tool-integrated reasoning (TIR) prompts, the two halves of DeepSeekMath's Table 5.

    grpokit eval MODEL --data FILE... --output-dir DIR [--mode cot,tir] [--k K] ...
    grpokit eval --compare DIR_BEFORE DIR_AFTER [--output-dir DIR]
    grpokit eval --completions FILE --data FILE [--completion-column COL] [--key COL] [--output-dir DIR]

Generation writes, under DIR:
    results.json                          accuracy (and maj@k, pass@k with --k) per dataset x mode,
                                          counts, seconds, engine, prompt format, sandbox isolation
    report.md                             the same as tables
    completions-<dataset>-<mode>.jsonl    one line per question: prompt, completion (tool output
                                          included), extracted answer, correct, tool calls
A rerun with the same settings skips the questions already in the completions files.

Prompts, answers and grading are the task's (grpokit.tasks). MODEL inside a run directory (a
checkpoint, or the run itself) is evaluated by that run's task and settings: the prompts its
training rendered, its answer rule and grading, max_new_tokens = grpo.max_completion_length. So
`grpokit eval RUN_DIR` (the run's own held-out questions, heldout.jsonl) gives the accuracy of
the run's after-RL table. Any other model is evaluated by the math task (grpokit.tasks.math):
DeepSeekMath's instructions, in the tokenizer's chat template or "User: ...\\n\\nAssistant:".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpokit.checkpoint import CheckpointError, CheckpointManager
from grpokit.config import Config, DataSource, EvalConfig, ModelConfig, RolloutConfig, load_config
from grpokit.data.files import DatasetError, Fixes, read_file_records
from grpokit.data.sources import FORMAT_COLUMNS, detect_format, load_source, reference_answer, say_skipped
from grpokit.eval.evaluate import majority_answer, pass_at_k
from grpokit.data.templates import PLAIN_LAYOUTS
from grpokit.eval.tir import OUTPUT_STOP, EngineGenerate, TIRTrace, Timings, rollouts, timed_sandbox
from grpokit.models.loading import (DeviceUnavailable, ModelNotFound, is_lora_adapter, load_model_and_tokenizer,
                                    local_weights_dir, resolve_device)
from grpokit.progress import progress as progress_bar
from grpokit.rewards.answers import final_answers
from grpokit.rollout import ENGINES, SamplingParams, engine_spec, make_engine
from grpokit.rundir import RUN_CONFIG
from grpokit.sandbox import namespaces_available
from grpokit.tasks import Task, task_for
from grpokit.tasks.math import MathTask

MODES = ("cot", "tir")
MODE_TITLES = {"cot": "CoT", "tir": "TIR"}
# Where a question and its reference live when the file is neither GSM8K- nor MATH-shaped.
QUESTION_COLUMNS = ("question", "problem", "prompt")
ANSWER_COLUMNS = ("answer", "solution", "ground_truth")
# File names that say nothing about the benchmark ("test.jsonl"): such a file is named after its folder.
GENERIC_STEMS = {"test", "train", "dev", "val", "valid", "validation", "eval", "data", "questions"}
PLAIN_LAYOUT = PLAIN_LAYOUTS["user-assistant"]  # a model's layout without a chat template and without a run's settings
HELDOUT = "heldout.jsonl"  # a training run's held-out questions (question, answer, the task's columns)
RESULTS, REPORT, COMPARE = "results.json", "report.md", "compare.md"
# Settings that must match for a rerun to append to an earlier run's completions.
RESUME_KEYS = ("model_path", "prompt_format", "task", "max_new_tokens", "max_tool_calls", "k", "temperature", "seed")
# A bad row's fixes, in grpokit eval's flags.
EVAL_FIXES = Fixes(skip="pass --skip-malformed-lines to skip and count such rows",
                   columns="name the columns with --question-column and --answer-column")
# Options that are also config keys take the config's defaults, so `grpokit eval` and a training
# run's evaluation cannot drift apart.
EVAL, ROLLOUT, MODEL = EvalConfig(), RolloutConfig(), ModelConfig()


class EvalError(ValueError):
    """Inputs `grpokit eval` cannot use as given; the message says what to change."""


# --------------------------------------------------------------------------- data


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


# --------------------------------------------------------------------------- model and prompts


def resolve_model(model: str) -> str:
    """A model directory as given; for a run directory, its newest intact checkpoint
    (checkpoints/latest, else the highest step-N; checkpoints/sft for an SFT-only run).
    Anything else is passed on as a hub id. A LoRA adapter directory loads with its base."""
    path = Path(model)
    if not path.is_dir():
        return model
    if (path / "config.json").is_file() or is_lora_adapter(path):
        return str(path)
    checkpoints = path / "checkpoints"
    latest = CheckpointManager(checkpoints).latest() if checkpoints.is_dir() else None
    if latest is not None:
        return str(latest)
    if (checkpoints / "sft" / "config.json").is_file():
        return str(checkpoints / "sft")
    raise CheckpointError(f"{path} is neither a model directory (no config.json) nor a run directory with an "
                          "intact checkpoint under checkpoints/; pass a checkpoint directory or a hub id")


def run_config(model_path: str) -> Config | None:
    """The config of the run a checkpoint (or run directory) belongs to: its own config.yaml, else
    its run directory's; None for a model that did not come from a grpokit run."""
    path = Path(model_path)
    for candidate in (path / RUN_CONFIG, path.parent.parent / RUN_CONFIG):
        if path.is_dir() and candidate.is_file():
            return load_config(candidate)
    return None


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


def write_heldout_completions(path: str | Path, rows: list[dict], result) -> Path:
    """A run's greedy held-out completions (an EvalResult's), graded: question, answer, completion, correct."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for row, completion, correct in zip(rows, result.greedy_completions, result.greedy_correct, strict=True):
            record = {"question": row.get("question", row["prompt"]), "answer": row.get("answer"),
                      "completion": completion, "correct": correct}
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return path


def default_task() -> MathTask:
    """The task of a model without a run: math, in DeepSeekMath's layout without a chat template."""
    config = Config()
    config.data.plain_layout = "user-assistant"
    return MathTask(config)


def prompt_format(tokenizer) -> str:
    """"chat template" when the tokenizer has one, else "plain" (PLAIN_LAYOUT)."""
    return "chat template" if getattr(tokenizer, "chat_template", None) else "plain"


def describe_prompt_format(layout: str) -> str:
    return f"plain {json.dumps(PLAIN_LAYOUT)}" if layout == "plain" else layout


def render_prompt(question: str, mode: str, tokenizer, task: Task | None = None) -> str:
    """The task's prompt of `question` in `mode` (cot or tir); by default the math task's:
    DeepSeekMath's instruction after the question, in the tokenizer's chat template when it has
    one, else in "User: {prompt}\\n\\nAssistant:"."""
    return task_prompt(task or default_task(), {"question": question}, mode, tokenizer)


def task_prompt(task: Task, row: dict, mode: str, tokenizer) -> str:
    """The prompt `task` gives `row` in `mode`; a task without prompt() is evaluated on the
    prompts its rows carry (cot only)."""
    prompt = task.prompt(row, mode, tokenizer) if hasattr(task, "prompt") else (
        row.get("rendered_prompt") if mode == "cot" else None)
    if prompt is None:
        raise EvalError(f"task {task.name!r} has no {MODE_TITLES[mode]} prompt for its questions; evaluate with "
                        f"--mode {'cot' if mode == 'tir' else 'tir'}")
    return prompt


# --------------------------------------------------------------------------- generation


@dataclass
class EvalSettings:
    max_new_tokens: int = 1024
    max_tool_calls: int = EVAL.max_tool_calls
    k: int = 0
    temperature: float = EVAL.temperature
    seed: int = 0
    batch_size: int = 64
    tool_timeout: float = EVAL.tool_timeout_s
    max_model_len: int = 4096


def questions_too_long(bench: Benchmark, mode: str, tokenizer, settings: EvalSettings, task: Task | None = None) -> int:
    """How many of the benchmark's prompts leave no room for max_new_tokens within max_model_len:
    they get no completion (never a cut question) and count as wrong."""
    room = settings.max_model_len - settings.max_new_tokens
    task = task or default_task()
    prompts = [task_prompt(task, bench.row(i), mode, tokenizer) for i in range(len(bench))]
    return sum(len(ids) > room for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])


def say_questions_too_long(count: int, bench: Benchmark, mode: str, settings: EvalSettings) -> None:
    if count:
        print(f"grpokit: {count} of {len(bench)} {bench.name} {MODE_TITLES[mode]} questions do not fit "
              f"--max-model-len={settings.max_model_len} with --max-new-tokens={settings.max_new_tokens}: they get "
              "no completion and count as wrong (evaluation never truncates a question); raise --max-model-len or "
              "lower --max-new-tokens", file=sys.stderr)


def _sample_record(trace: TIRTrace, reason: str, answer: str | None, correct: bool) -> dict:
    return {"completion": trace.completion, "extracted_answer": answer, "correct": correct,
            "tool_calls": trace.tool_calls, "stop_reason": reason}


def evaluate_chunk(bench: Benchmark, indices: list[int], mode: str, engine, tokenizer, settings: EvalSettings,
                   timings: Timings, task: Task | None = None) -> list[dict]:
    """Completion records (greedy, plus --k samples) of the questions at `indices`, prompted,
    read and graded by `task` (default: the math task)."""
    task = task or default_task()
    stop = (OUTPUT_STOP,) if mode == "tir" else ()
    rows = [bench.row(i) for i in indices]
    prompts = [task_prompt(task, row, mode, tokenizer) for row in rows]
    run_fn = timed_sandbox(timings, settings.tool_timeout)
    greedy_params = SamplingParams(settings.max_new_tokens, 0.0, 1.0, settings.batch_size, stop=stop)
    greedy = rollouts(EngineGenerate(engine, tokenizer, greedy_params, settings.max_model_len, settings.seed,
                                     timings), prompts, mode, settings.max_tool_calls, run_fn)
    samples: list[tuple[TIRTrace, str]] = []
    if settings.k:
        params = SamplingParams(settings.max_new_tokens, settings.temperature, 1.0, settings.batch_size, stop=stop)
        repeated = [p for p in prompts for _ in range(settings.k)]
        samples = rollouts(EngineGenerate(engine, tokenizer, params, settings.max_model_len, settings.seed, timings),
                           repeated, mode, settings.max_tool_calls, run_fn)
    start = time.perf_counter()
    completions = [t.completion for t, _ in greedy + samples]
    read_answer = task.tir_answer if mode == "tir" else task.extract_answer
    answers = [read_answer(c) for c in completions]
    correct = [bool(ok) for ok in task.grade(rows + [r for r in rows for _ in range(settings.k)], completions)]
    timings.score += time.perf_counter() - start
    records = []
    for j, i in enumerate(indices):
        trace, reason = greedy[j]
        record = {"index": i, "question": bench.questions[i], "reference": bench.references[i],
                  "prompt": prompts[j], **_sample_record(trace, reason, answers[j], correct[j])}
        if settings.k:
            first = len(indices) + j * settings.k
            record["samples"] = [_sample_record(*samples[s - len(indices)], answers[s], correct[s])
                                 for s in range(first, first + settings.k)]
        records.append(record)
    return records


# --------------------------------------------------------------------------- completion files


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
            answers = [s["extracted_answer"] for s in r["samples"]]
            hits = [bool(s["correct"]) for s in r["samples"]]
            passes += pass_at_k(len(hits), sum(hits), min(k, len(hits)))
            voted = majority_answer(answers)  # right when a sample giving that answer was judged right
            majority += voted is not None and any(ok for a, ok in zip(answers, hits) if a == voted)
        out[f"maj@{k}"] = majority / n
        out[f"pass@{k}"] = passes / n
    return out


# --------------------------------------------------------------------------- results and reports


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
    about = [f"engine {results['engine']}", f"prompts: {describe_prompt_format(results['prompt_format'])}"]
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


def compare_markdown(before: dict, after: dict, before_label: str, after_label: str) -> str:
    """Table 5's shape: one row per model, a column per dataset x mode, then the change in points."""
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
    return ("Greedy accuracy (%) before and after; change in percentage points.\n\n"
            + markdown_table(["model", *map(_title, columns)], rows))


def compare_runs(before_dir: str, after_dir: str, output_dir: str | None = None) -> tuple[str, Path]:
    """The comparison table of two evaluation directories, written to compare.md."""
    before, after = read_results(before_dir), read_results(after_dir)
    labels = [before.get("model", before_dir), after.get("model", after_dir)]
    if labels[0] == labels[1]:
        labels = [str(before_dir), str(after_dir)]
    table = compare_markdown(before, after, *labels)
    target = Path(output_dir or after_dir)
    target.mkdir(parents=True, exist_ok=True)
    (target / COMPARE).write_text(table)
    return table, target / COMPARE


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


# --------------------------------------------------------------------------- the commands


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


def run_evaluation(model: str, data: Sequence[str], out_dir: str, modes: Sequence[str], settings: EvalSettings,
                   engine_name: str = "hf", max_rows: int = 0, device: str = "auto", dtype: str = "auto",
                   kv_cache_gb: float = 1.0, question_column: str = "", answer_column: str = "",
                   progress: bool = True, skip_malformed: bool = False) -> dict:
    """Generate, score and write everything for every dataset x mode; returns results.json's content."""
    import torch

    # before any model loads
    benchmarks = load_benchmarks(data, max_rows, question_column, answer_column, skip_malformed)
    out = writable_output_dir(out_dir)
    model_path = resolve_model(model)
    if model_path != model:
        print(f"grpokit: evaluating {model_path}", file=sys.stderr)
    config = run_config(model_path)
    task = task_for(config) if config is not None else default_task()
    if config is not None:
        print(f"grpokit: evaluating with the run's task ({task.name}) and its prompts", file=sys.stderr)
    settings.max_new_tokens = settings.max_new_tokens or (config.grpo.max_completion_length if config else 1024)
    settings.batch_size = settings.batch_size or (config.eval.batch_size if config else 64)
    load_start = time.perf_counter()
    policy, tokenizer = load_model_and_tokenizer(model_path, dtype, device)
    layout = prompt_format(tokenizer)
    if layout != "chat template" and config is None:
        print(f"grpokit: the tokenizer has no chat template; prompts use the layout {json.dumps(PLAIN_LAYOUT)}",
              file=sys.stderr)
    if not settings.max_model_len:
        settings.max_model_len = int(getattr(policy.config, "max_position_embeddings", 0) or 4096)
    torch.manual_seed(settings.seed)
    engine = make_engine(RolloutConfig(engine=engine_name, kv_cache_gb=kv_cache_gb,
                                       max_model_len=settings.max_model_len), policy, tokenizer, settings.seed,
                         weights_dir=local_weights_dir(model_path) if engine_spec(engine_name).copies_weights else None)
    plain = PLAIN_LAYOUT if config is None else f"task {task.name}'s prompts (the run's config.yaml)"
    header = {"model": model, "model_path": model_path, "engine": engine_name, "prompt_format": layout,
              "task": task.name, "prompt_layout": plain if layout == "plain" else "the tokenizer's chat template",
              "load_seconds": time.perf_counter() - load_start,
              "sandbox_isolated": namespaces_available() if "tir" in modes else None,
              "settings": {"model_path": model_path, "prompt_format": layout, "task": task.name, **asdict(settings),
                           "max_rows": max_rows}}
    results = ResultsFile(out, header)
    results.save()
    for bench in benchmarks:
        for mode in modes:
            path = completions_path(out, bench.name, mode)
            done = read_completions(path, bench)
            todo = [i for i in range(len(bench)) if i not in done]
            too_long = questions_too_long(bench, mode, tokenizer, settings, task)
            say_questions_too_long(too_long, bench, mode, settings)
            timings, start = Timings(), time.perf_counter()
            with progress_bar(total=len(bench), initial=len(bench) - len(todo), unit="question",
                              desc=f"{bench.name} {MODE_TITLES[mode]}", enabled=progress) as bar:
                for first in range(0, len(todo), settings.batch_size):
                    chunk = todo[first : first + settings.batch_size]
                    records = evaluate_chunk(bench, chunk, mode, engine, tokenizer, settings, timings, task)
                    _append(path, records)
                    done.update((r["index"], r) for r in records)
                    bar.update(len(chunk))
            previous = results.cell(bench.name, mode)
            seconds = {key: previous.get(key, 0.0) + value for key, value in
                       (("seconds", time.perf_counter() - start), ("generate_seconds", timings.generate),
                        ("tool_seconds", timings.tools), ("score_seconds", timings.score))}
            cell = {**metrics([done[i] for i in range(len(bench))], settings.k), **seconds,
                    "generate_calls": previous.get("generate_calls", 0) + timings.generate_calls,
                    "programs_run": previous.get("programs_run", 0) + timings.programs,
                    "resumed": len(bench) - len(todo), "too_long": too_long, "data": bench.path,
                    "completions": path.name}
            results.update(bench.name, mode, cell)
    (out / REPORT).write_text(report_markdown(results.data))
    return results.data


def _column(record: dict, column: str):
    """record[column]; a dotted name walks nested objects ("175b_verification.solution")."""
    if column in record:
        return record[column]
    value = record
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def align_completions(path: str, bench: Benchmark, completion_column: str = "completion",
                      key: str | None = None, max_rows: int = 0) -> list[tuple[int, str]]:
    """(question index, completion) pairs of a completions file.

    With `key` (default "question" when every record has one), a record goes to the data row
    whose question equals record[key] (whitespace at the ends ignored; repeated questions are
    matched in order). Without one, the i-th record goes to the i-th row, and the counts must
    agree (after both are cut to `max_rows`).
    """
    records, _ = read_file_records(path, skip_malformed=False)
    if key is None and records and all(isinstance(r, dict) and "question" in r for _, r in records):
        key = "question"
    if not key and max_rows:
        records = records[:max_rows]
    if not key and len(records) != len(bench):
        raise EvalError(f"{path} has {len(records)} completions for {len(bench)} rows of {bench.path}; records are "
                        "matched by order without a question column: give as many, or match them with --key COLUMN")
    rows_of: dict[str, list[int]] = {}
    for i, q in enumerate(bench.questions):
        rows_of.setdefault(q.strip(), []).append(i)
    pairs = []
    for n, (where, record) in enumerate(records):
        columns = sorted(record) if isinstance(record, dict) else type(record).__name__
        completion = _column(record, completion_column) if isinstance(record, dict) else None
        if not isinstance(completion, str):
            raise DatasetError(f"{where}: no text in column {completion_column!r} (the record has {columns}); "
                               "name the completion column with --completion-column")
        if not key:
            pairs.append((n, completion))
            continue
        value = _column(record, key)
        if not isinstance(value, str):
            raise DatasetError(f"{where}: no text in the key column {key!r} (the record has {columns})")
        candidates = rows_of.get(value.strip())
        if not candidates:
            raise EvalError(f"{where}: its {key} matches no question of {bench.path}")
        pairs.append((candidates.pop(0) if len(candidates) > 1 else candidates[0], completion))
    return pairs


def score_completions(path: str, data: str, completion_column: str = "completion", key: str | None = None,
                      mode: str = "cot", max_rows: int = 0, out_dir: str | None = None, question_column: str = "",
                      answer_column: str = "", skip_malformed: bool = False) -> dict:
    """Grade the completions of a file against one data file without generating; returns the
    results (and writes results.json, report.md and the graded completions under out_dir)."""
    bench = load_benchmark(data, max_rows, question_column, answer_column, skip_malformed)
    pairs = align_completions(path, bench, completion_column, key, max_rows)
    start = time.perf_counter()
    task = default_task()
    answers = [(task.tir_answer if mode == "tir" else task.extract_answer)(c) for _, c in pairs]
    correct = task.grade([bench.row(i) for i, _ in pairs], [c for _, c in pairs])
    records = [{"index": i, "question": bench.questions[i], "reference": bench.references[i], "completion": c,
                "extracted_answer": a, "correct": ok, "tool_calls": c.count(OUTPUT_STOP)}
               for (i, c), a, ok in zip(pairs, answers, correct)]
    seconds = time.perf_counter() - start
    cell = {**metrics(records, 0), "seconds": seconds, "score_seconds": seconds, "data": bench.path,
            "completions_scored": str(path)}
    results = {"model": f"completions of {path}", "engine": "none (scored)", "prompt_format": "as given",
               "sandbox_isolated": None, "settings": {"k": 0, "max_new_tokens": None, "max_tool_calls": None,
                                                       "completion_column": completion_column, "key": key},
               "results": {bench.name: {mode: cell}}}
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        target = completions_path(out, bench.name, mode)
        target.unlink(missing_ok=True)
        _append(target, records)
        cell["completions"] = target.name
        _write_json(out / RESULTS, results)
        (out / REPORT).write_text(report_markdown(results))
    return results


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless it has none worth showing (None, "", False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default in ("", []) or default is argparse.SUPPRESS \
                or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpokit eval", formatter_class=DefaultsHelpFormatter,
        description="Accuracy on math benchmarks with chain-of-thought (cot) and tool-integrated (tir) prompts, "
                    "as in DeepSeekMath's Table 5.",
        epilog="Completions files for scoring: JSONL/JSON/Parquet records with a completion column. Records with a "
               "'question' field (or the column --key names) are matched to the data row with the same question; "
               "otherwise the i-th record belongs to the i-th data row.")
    p.add_argument("model", nargs="?", help="a model directory, a hub id, or a run directory (its newest checkpoint)")
    p.add_argument("--data", nargs="+", action="extend", default=[], metavar="FILE",
                   help="JSONL/JSON/Parquet in GSM8K, MATH or plain (question, answer) form; NAME=FILE names it. "
                        f"Default for a run directory: its held-out questions ({HELDOUT})")
    p.add_argument("--mode", default="cot,tir", help="cot, tir or both (cot,tir)")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", help="where results, report and completions go")
    p.add_argument("--max-rows", type=int, default=0, help="first N questions of each file; 0 = all")
    p.add_argument("--k", type=int, default=0, help="also draw K samples per question for maj@K and pass@K")
    p.add_argument("--temperature", type=float, default=EVAL.temperature,
                   help="sampling temperature of the --k samples (default: %(default)s, as eval.temperature)")
    p.add_argument("--rollout.engine", "--engine", dest="engine", choices=sorted(ENGINES), default=ROLLOUT.engine,
                   help="hf: transformers' generate; vllm: a vLLM engine; or another registered engine")
    p.add_argument("--rollout.kv_cache_gb", "--kv-cache-gb", dest="kv_cache_gb", type=float,
                   default=ROLLOUT.kv_cache_gb, help="vllm: GiB for its KV cache")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per generation (per TIR round); default: the run's grpo.max_completion_length for a "
                        "run's checkpoint, else 1024")
    p.add_argument("--max-tool-calls", type=int, default=EVAL.max_tool_calls,
                   help="TIR: rounds of generation, each may run a program (default: %(default)s, as "
                        "eval.max_tool_calls)")
    p.add_argument("--tool-timeout", type=float, default=EVAL.tool_timeout_s,
                   help="TIR: seconds a program may run (default: %(default)s, as eval.tool_timeout_s)")
    p.add_argument("--max-model-len", type=int, default=ROLLOUT.max_model_len,
                   help="longest context in tokens; 0 = the model's max_position_embeddings")
    p.add_argument("--batch-size", type=int, default=None,
                   help="questions per batch (and per resumable write); default: the run's eval.batch_size for a "
                        "run's checkpoint (the batches its own evaluation made), else 64")
    p.add_argument("--seed", type=int, default=Config.seed, help="seed of the --k samples")
    p.add_argument("--device", default=MODEL.device, help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=MODEL.dtype, help="auto (bf16 on CUDA, else fp32), bf16, fp16 or fp32")
    p.add_argument("--question-column", default="", help="column holding the question (default: recognised)")
    p.add_argument("--answer-column", default="", help="column holding the reference (default: recognised)")
    p.add_argument("--skip-malformed-lines", action="store_true",
                   help="leave out (and count) rows that cannot be read, or whose reference answer cannot, instead "
                        "of stopping; the results cover the rows read")
    p.add_argument("--compare", nargs=2, metavar=("DIR_BEFORE", "DIR_AFTER"),
                   help="print and write (DIR_AFTER/compare.md, or --output-dir) the before/after table")
    p.add_argument("--completions", metavar="FILE", help="score this file's completions against --data instead of "
                                                         "generating")
    p.add_argument("--completion-column", default="completion",
                   help="scoring: the column with the completion; a dotted name reaches into objects")
    p.add_argument("--key", default=None, help="scoring: the record column matched to the data's question")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _modes(text: str) -> list[str]:
    modes = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise EvalError(f"--mode takes cot, tir or cot,tir; got {text!r}")
    return list(dict.fromkeys(modes))


def _check_numbers(args) -> None:
    for name in ("max_new_tokens", "max_tool_calls", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("max_rows", "k", "max_model_len"):
        if getattr(args, name) < 0:
            raise EvalError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.k and args.temperature <= 0:
        raise EvalError(f"--k samples need --temperature > 0, got {args.temperature}")
    if args.tool_timeout <= 0:
        raise EvalError(f"--tool-timeout must be positive, got {args.tool_timeout}")
    resolve_device(args.device, "--device")  # before the data is read or the model loads


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.compare:
            if args.model or args.data or args.completions:
                raise EvalError("--compare takes two evaluation directories and nothing else (no MODEL, --data)")
            table, path = compare_runs(*args.compare, args.output_dir)
            print(table)
            print(f"wrote {path}")
            return 0
        if args.completions:
            if args.model or len(args.data) != 1:
                raise EvalError("--completions FILE needs exactly one --data FILE (its questions and references) "
                                "and no MODEL")
            modes = _modes(args.mode if args.mode != "cot,tir" else "cot")
            if len(modes) != 1:
                raise EvalError("--completions scores one mode; --mode names it (cot or tir)")
            results = score_completions(args.completions, args.data[0], args.completion_column, args.key, modes[0],
                                        args.max_rows, args.output_dir, args.question_column, args.answer_column,
                                        args.skip_malformed_lines)
            print(report_markdown(results))
            if args.output_dir:
                print(f"wrote {Path(args.output_dir) / RESULTS}")
            return 0
        if args.model and not args.data and (Path(args.model) / HELDOUT).is_file():
            args.data = [str(Path(args.model) / HELDOUT)]  # the run's own held-out questions
            args.question_column, args.answer_column = args.question_column or "question", args.answer_column or "answer"
        if not args.model or not args.data or not args.output_dir:
            raise EvalError("usage: grpokit eval MODEL --data FILE... --output-dir DIR (or --compare / --completions);"
                            " see grpokit eval --help")
        _check_numbers(args)
        settings = EvalSettings(args.max_new_tokens or 0, args.max_tool_calls, args.k, args.temperature if args.k else 0.0,
                                args.seed, args.batch_size or 0, args.tool_timeout, args.max_model_len)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        results = run_evaluation(args.model, args.data, args.output_dir, _modes(args.mode), settings, args.engine,
                                 args.max_rows, args.device, args.dtype, args.kv_cache_gb, args.question_column,
                                 args.answer_column, progress=not args.quiet,
                                 skip_malformed=args.skip_malformed_lines)
        print(report_markdown(results))
        print(f"wrote {Path(args.output_dir) / RESULTS}, {REPORT} and the completions files")
        return 0
    except (DatasetError, EvalError, CheckpointError, ModelNotFound, DeviceUnavailable) as err:
        print(f"grpokit: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grpokit: interrupted; the completions written so far are kept: rerun to resume", file=sys.stderr)
        return 130
