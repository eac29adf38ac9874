"""Greedy accuracy, pass@k and maj@k of a model on rows with reference answers; greedy
tool-integrated reasoning on the same rows (`evaluate_tir`)."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from math import comb

from grpokit import distributed
from grpokit.config import Config
from grpokit.eval.tir import RolloutLimits, Timings, rollouts
from grpokit.tools.python import OUTPUT_STOP
from grpokit.tools.python import PythonTool
from grpokit.run.progress import progress as progress_bar
from grpokit.rewards.scoring import configured_rewards, row_columns, score_completions
from grpokit.rollout import HFEngine, SamplingParams, max_model_len
from grpokit.tools.sandbox import namespaces_available


@dataclass
class EvalResult:
    greedy_accuracy: float
    pass_at_k: float
    maj_at_k: float
    k: int
    num_questions: int
    greedy_completions: list[str] = field(default_factory=list, repr=False)
    greedy_correct: list[bool] = field(default_factory=list, repr=False)  # each greedy completion, by the grading rule
    greedy_seconds: float = 0.0  # generating and grading the greedy completions
    tir: TIRResult | None = None  # the same questions with tool-integrated reasoning, when evaluated
    # questions without a reference answer: each reward's mean over the greedy completions (no accuracy)
    reward_means: dict[str, float] | None = None

    def headline(self) -> str:
        """"greedy accuracy X%, pass@k Y%"; greedy alone when no samples were drawn (k = 0); each
        reward's mean where the questions have no reference answer."""
        if self.reward_means is not None:
            return "mean reward " + ", ".join(f"{name} {value:.3f}" for name, value in self.reward_means.items())
        return f"greedy accuracy {self.greedy_accuracy:.1%}" + (f", pass@{self.k} {self.pass_at_k:.1%}" if self.k else "")

    def as_dict(self) -> dict:
        """The numbers, without the completions (the TIR result's as its own as_dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("greedy_completions", "greedy_correct", "tir")}
        out["tir"] = self.tir.as_dict() if self.tir is not None else None
        return out


@dataclass
class TIRResult:
    """Greedy tool-integrated reasoning on a set of questions, and where its time went."""

    greedy_accuracy: float
    num_questions: int
    programs: int  # programs run, over all questions and rounds
    seconds: float
    generate_seconds: float
    tool_seconds: float
    isolated: bool  # whether the programs ran in namespaces (no network); see grpokit.tools.sandbox
    stop_reasons: dict[str, int] = field(default_factory=dict)
    completions: list[str] = field(default_factory=list, repr=False)
    correct: list[bool] = field(default_factory=list, repr=False)  # each completion's verdict

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("completions", "correct")}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_answer(answers: list[str | None]) -> str | None:
    """Most frequent non-missing answer; ties go to the answer seen first."""
    votes = Counter(a for a in answers if a is not None)
    return max(votes, key=lambda a: (votes[a], -answers.index(a))) if votes else None


def sample_scores(answers: list[str | None], hits: list[bool], k: int) -> tuple[float, bool]:
    """One question's samples: their pass@k (k at most the samples drawn), and whether their
    majority answer is right (it is when a sample giving that answer was judged right)."""
    voted = majority_answer(answers)
    majority_right = voted is not None and any(ok for a, ok in zip(answers, hits) if a == voted)
    return pass_at_k(len(hits), sum(hits), min(k, len(hits))), majority_right


def _string_equal(predicted: str, reference: str) -> bool:
    return predicted.strip() == reference.strip()


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    extract_answer: Callable[[str], str | None],
    max_new_tokens: int,
    k: int = 8,
    temperature: float = 1.0,
    batch_size: int = 512,
    equivalent: Callable[[str, str], bool] = _string_equal,
    answer_key: str = "answer",
    engine=None,
    grade: Callable[[list[dict], list[str]], list[bool]] | None = None,
    bar=None,
) -> EvalResult:
    """Greedy accuracy, and pass@k / maj@k from k samples at `temperature`, sampled through
    `engine` (default: transformers' generate on `model`); k = 0: greedy only (pass@k and maj@k
    are NaN).

    rows: dicts with "prompt" and `answer_key`. A completion is correct when its extracted
    answer is `equivalent` to the reference, or by `grade(rows, completions)` when given (a
    verifier such as math-verify); maj@k votes over the extracted answers. `bar` (grpokit.run.progress)
    advances by one per question generated, greedily and then k times.
    """
    if not rows:
        raise ValueError("evaluate got no rows")
    engine = engine or HFEngine(model, tokenizer)

    def judge(rows_: list[dict], completions: list[str]) -> list[bool]:
        if grade is not None:
            return [bool(ok) for ok in grade(rows_, completions)]
        return [(a := extract_answer(c)) is not None and equivalent(a, str(r[answer_key]))
                for r, c in zip(rows_, completions)]

    prompts = [r["prompt"] for r in rows]
    start = time.perf_counter()
    greedy = generate_in_calls(engine, prompts, 1, SamplingParams(max_new_tokens, 0.0, 1.0, batch_size), bar)
    greedy_correct = judge(rows, greedy)
    greedy_seconds = time.perf_counter() - start
    n = len(rows)
    if k == 0:
        return EvalResult(sum(greedy_correct) / n, math.nan, math.nan, 0, n, greedy, greedy_correct, greedy_seconds)
    sampled = generate_in_calls(engine, prompts, k, SamplingParams(max_new_tokens, temperature, 1.0, batch_size), bar)
    hits = judge([row for row in rows for _ in range(k)], sampled)
    passes = majority = 0.0
    for q in range(len(rows)):
        answers = [extract_answer(c) for c in sampled[q * k : (q + 1) * k]]
        passed, majority_right = sample_scores(answers, hits[q * k : (q + 1) * k], k)
        passes += passed
        majority += majority_right
    return EvalResult(sum(greedy_correct) / n, passes / n, majority / n, k, n, greedy, greedy_correct, greedy_seconds)


def generate_in_calls(engine, prompts: list[str], k: int, params: SamplingParams, bar=None) -> list[str]:
    """k completions of each prompt (groups contiguous), in calls of params.batch_size sequences,
    the batches the engine would make anyway, so that `bar` can show them done."""
    per_call = max(1, params.batch_size // k)
    completions: list[str] = []
    for first in range(0, len(prompts), per_call):
        part = prompts[first : first + per_call]
        completions += engine.generate(part, k, params).completions
        if bar is not None:
            bar.update(len(part))
    return completions


def evaluate_tir(
    engine,
    tokenizer,
    rows: list[dict],
    extract_answer: Callable[[str], str | None],
    max_new_tokens: int,
    max_model_len: int,
    max_tool_calls: int = 2,
    tool_timeout_s: float = 10.0,
    batch_size: int = 512,
    answer_key: str = "answer",
    bar=None,
) -> TIRResult:
    """Greedy tool-integrated reasoning: each row's "prompt" is generated from until the model
    writes "```output", its program runs in grpokit.tools.sandbox, the output is appended, and
    generation goes on, for at most `max_tool_calls` calls, `max_new_tokens` bounding the whole
    completion, tool output included: the multi-turn rollout RL samples with (eval/tir.py). A
    completion is right when its extracted answer equals the row's reference as a string."""
    if not rows:
        raise ValueError("evaluate_tir got no rows")
    start, timings = time.perf_counter(), Timings()
    params = SamplingParams(max_new_tokens, 0.0, 1.0, batch_size, stop=(OUTPUT_STOP,))
    traced = []
    limits = RolloutLimits(max_model_len, 0, max_tool_calls, PythonTool(timeout_s=tool_timeout_s))
    for first in range(0, len(rows), batch_size):  # each question's rounds are its own: calls of batch_size
        part = [r["prompt"] for r in rows[first : first + batch_size]]
        traced += rollouts(engine, tokenizer, part, "tir", params, limits, timings)
        if bar is not None:
            bar.update(len(part))
    completions = [trace.completion for trace, _ in traced]
    correct = [(a := extract_answer(c)) is not None and _string_equal(a, str(r[answer_key]))
               for r, c in zip(rows, completions)]
    return TIRResult(sum(correct) / len(rows), len(rows), timings.programs, time.perf_counter() - start,
                     timings.generate, timings.tools, namespaces_available(),
                     dict(Counter(reason for _, reason in traced)), completions, correct)


def evaluate_task(task, model, tokenizer, rows: list[dict], config: Config, engine=None,
                  progress: bool = False, desc: str = "held-out eval") -> EvalResult:
    """Greedy accuracy, pass@k and maj@k on `rows`, graded by the task's rule (a
    grpokit.tasks.Task's grade); with eval.tir, and a task with a
    TIR form, greedy tool-integrated accuracy on the same questions too (result.tir). With
    `progress`, one bar counts every pass over the questions: greedy, k samples, TIR."""
    e = config.eval
    engine = engine or HFEngine(model, tokenizer)
    if config.rewards and any(r.get("answer") is None for r in rows):
        return evaluate_reward_means(engine, tokenizer, rows, config, progress, desc)
    tir_rows = task.tir_rows(rows, tokenizer) if e.tir else None
    passes = 1 + bool(e.k) + bool(tir_rows)
    with progress_bar(total=passes * len(rows), desc=f"{desc} ({passes} passes)", unit="question",
                      enabled=progress and distributed.is_main()) as bar:
        result = evaluate(model, tokenizer, rows, task.extract_answer, config.grpo.max_completion_length, k=e.k,
                          temperature=e.temperature, batch_size=e.batch_size, engine=engine,
                          grade=task.grade, bar=bar)
        if tir_rows:
            result.tir = evaluate_tir(engine, tokenizer, tir_rows, task.tir_answer,
                                      config.grpo.max_completion_length, engine_model_len(engine, config, model),
                                      e.max_tool_calls, e.tool_timeout_s, e.batch_size, bar=bar)
    return result


def evaluate_reward_means(engine, tokenizer, rows: list[dict], config: Config, progress: bool = False,
                          desc: str = "held-out eval") -> EvalResult:
    """Questions without a reference answer (prompt-only rows the user's rewards score): greedy
    completions, scored by the run's rewards; each reward's mean over the questions it scored."""
    start = time.perf_counter()
    params = SamplingParams(config.grpo.max_completion_length, 0.0, 1.0, config.eval.batch_size)
    with progress_bar(total=len(rows), desc=f"{desc} (rewards)", unit="question",
                      enabled=progress and distributed.is_main()) as bar:
        greedy = generate_in_calls(engine, [r["prompt"] for r in rows], 1, params, bar)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in greedy]  # TRL's completion_ids
    scored = score_completions(configured_rewards(config, tokenizer), [r["prompt"] for r in rows], greedy,
                               row_columns(rows), ids)
    n = len(rows)
    return EvalResult(math.nan, math.nan, math.nan, 0, n, greedy, [None] * n, time.perf_counter() - start,
                      reward_means=scored.function_means())


def engine_model_len(engine, config: Config, model) -> int:
    """The longest context `engine` serves: its own max_model_len (vLLM), else rollout's setting."""
    return getattr(engine, "max_model_len", None) or max_model_len(config.rollout, model)
