"""`grpokit eval`: a model's accuracy on math benchmarks with chain-of-thought (CoT) and
tool-integrated reasoning (TIR) prompts, the two halves of DeepSeekMath's Table 5.

    grpokit eval MODEL --data FILE... --output-dir DIR [--mode cot,tir] [--eval.k K] ...
    grpokit eval --compare DIR_BEFORE DIR_AFTER [--output-dir DIR]
    grpokit eval --completions FILE --data FILE [--completion-column COL] [--key COL] [--output-dir DIR]

Generation writes, under DIR:
    results.json                          accuracy (and maj@k, pass@k with --eval.k) per dataset x mode,
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

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grpokit.errors import renamed_names
from grpokit.run.checkpoint import CheckpointError, CheckpointManager
from grpokit.checks import load_config
from grpokit.config import Config, EvalConfig, ModelConfig, RolloutConfig
from grpokit.data.files import DatasetError, read_file_records
from grpokit.errors import EvalError
from grpokit.eval.questions import Benchmark, load_benchmark, load_benchmarks
from grpokit.eval.records import (
    REPORT,
    RESULTS,
    ResultsFile,
    _append,
    _write_json,
    completions_path,
    read_completions,
    writable_output_dir,
)
from grpokit.eval.report import MODE_TITLES, PLAIN_LAYOUT, metrics, report_markdown
from grpokit.eval.tir import RolloutLimits, Timings, TIRTrace, rollouts
from grpokit.tools.python import OUTPUT_STOP
from grpokit.tools.python import PythonTool
from grpokit.models.loading import (
    is_lora_adapter,
    load_model_and_tokenizer,
    local_weights_dir,
)
from grpokit.run.progress import progress as progress_bar
from grpokit.rollout import RolloutEngineError, SamplingParams, engine_spec, make_engine
from grpokit.run.directory import RUN_CONFIG
from grpokit.tools.sandbox import namespaces_available
from grpokit.tasks import Task, task_for
from grpokit.tasks.math import MathTask

# Options that are also config keys take the config's defaults, so `grpokit eval` and a training
# run's evaluation cannot drift apart.
EVAL, ROLLOUT, MODEL = EvalConfig(), RolloutConfig(), ModelConfig()


# --------------------------------------------------------------------------- data


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
            return load_config(candidate, announce_renames=False)
    return None


def default_task() -> MathTask:
    """The task of a model without a run: math, in DeepSeekMath's layout without a chat template."""
    config = Config()
    config.data.plain_layout = "user-assistant"
    return MathTask(config)


def prompt_format(tokenizer) -> str:
    """"chat template" when the tokenizer has one, else "plain" (PLAIN_LAYOUT)."""
    return "chat template" if getattr(tokenizer, "chat_template", None) else "plain"


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
    """One `grpokit eval` run's generation settings. Those that are also config keys default to
    the config's (eval.*), so the command and a training run's evaluation do not drift apart."""

    max_new_tokens: int = 1024
    max_tool_calls: int = EVAL.max_tool_calls
    k: int = 0
    temperature: float = EVAL.temperature
    seed: int = 0
    batch_size: int = EVAL.batch_size
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
              f"--max-model-len={settings.max_model_len} with --grpo.max_completion_length={settings.max_new_tokens}: "
              "they get no completion and count as wrong (evaluation never truncates a question); raise "
              "--max-model-len or lower --grpo.max_completion_length", file=sys.stderr)


def _sample_record(trace: TIRTrace, reason: str, answer: str | None, correct: bool) -> dict:
    return {"completion": trace.completion, "extracted_answer": answer, "correct": correct,
            "tool_calls": trace.tool_calls, "stop_reason": reason}


def evaluate_chunk(bench: Benchmark, indices: list[int], mode: str, engine, tokenizer, settings: EvalSettings,
                   timings: Timings, task: Task | None = None) -> list[dict]:
    """Completion records (greedy, plus --eval.k samples) of the questions at `indices`, prompted,
    read and graded by `task` (default: the math task)."""
    task = task or default_task()
    stop = (OUTPUT_STOP,) if mode == "tir" else ()
    rows = [bench.row(i) for i in indices]
    prompts = [task_prompt(task, row, mode, tokenizer) for row in rows]
    tool = PythonTool(timeout_s=settings.tool_timeout)
    greedy_params = SamplingParams(settings.max_new_tokens, 0.0, 1.0, settings.batch_size, stop=stop)
    limits = RolloutLimits(settings.max_model_len, settings.seed, settings.max_tool_calls, tool)
    greedy = rollouts(engine, tokenizer, prompts, mode, greedy_params, limits, timings)
    samples: list[tuple[TIRTrace, str]] = []
    if settings.k:
        params = SamplingParams(settings.max_new_tokens, settings.temperature, 1.0, settings.batch_size, stop=stop)
        repeated = [p for p in prompts for _ in range(settings.k)]
        samples = rollouts(engine, tokenizer, repeated, mode, params, limits, timings)
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


# --------------------------------------------------------------------------- results and reports


# --------------------------------------------------------------------------- the commands


def run_evaluation(model: str, data: Sequence[str], out_dir: str, modes: Sequence[str], settings: EvalSettings,
                   engine_name: str = "hf", max_rows: int = 0, device: str = "auto", dtype: str = "auto",
                   kv_cache_gb: float = 1.0, question_column: str = "", answer_column: str = "",
                   progress: bool = True, skip_malformed: bool = False) -> dict:
    """Generate, score and write everything for every dataset x mode; returns results.json's content."""
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
    settings.batch_size = settings.batch_size or (config.eval.batch_size if config else EVAL.batch_size)
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
                    try:
                        records = evaluate_chunk(bench, chunk, mode, engine, tokenizer, settings, timings, task)
                    except RolloutEngineError as err:  # what is written stays; a rerun answers only the rest
                        raise RolloutEngineError(
                            f"{err}. {len(done)} of {len(bench)} {bench.name} questions ({mode}) are answered in "
                            f"{path}: rerun the same command to continue from there") from None
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


def grade_completion_file(path: str, data: str, completion_column: str = "completion", key: str | None = None,
                          mode: str = "cot", max_rows: int = 0, out_dir: str | None = None,
                          question_column: str = "", answer_column: str = "", skip_malformed: bool = False) -> dict:
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



# score_completions, this module's old name (rewards.scoring's score_completions is the one of that name)
__getattr__ = renamed_names(__name__, {"score_completions": (grade_completion_file, "grade_completion_file")})
