"""The Task interface and the choice of task from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from grpokit import distributed
from grpokit.config import Config
from grpokit.eval import EvalResult, evaluate
from grpokit.eval.evaluate import evaluate_tir
from grpokit.progress import progress as progress_bar
from grpokit.rollout import HFEngine, max_model_len


@dataclass
class TaskData:
    sft: list[dict]  # {"prompt", "completion"}: demonstrations for pi_SFT (may be empty)
    train: list[dict]  # {"prompt", "answer", ...}: RL questions
    heldout: list[dict]  # {"prompt", "answer", ...}: evaluation questions, never trained on (may be empty)


class Task(Protocol):
    name: str  # what task.name calls it (register_task sets it)
    # the reward that grades it in RL (a rewards[].name); a named task's replaces the default rewards; None if none
    reward: str | None
    # (row, steps) -> [bool]: which step first goes wrong, where a rule can tell; None otherwise
    step_labeller: Callable[[dict, list[str]], list[bool]] | None
    # (row, right completion, rng) -> the same solution with one slip (a hard negative); None where no rule can make one
    hard_negative: Callable[[dict, str, object], str | None] | None

    def data(self, tokenizer, sft: bool = True) -> TaskData: ...

    def extract_answer(self, completion: str) -> str | None: ...

    def tir_rows(self, rows: list[dict], tokenizer) -> list[dict] | None:
        """`rows` with tool-integrated prompts, or None when the task (or tokenizer) has no TIR form."""

    def tir_answer(self, completion: str) -> str | None: ...

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        """Rule-based correctness of each completion against its row's reference."""

    def report(self, result: EvalResult) -> dict[str, float]:
        """Task-specific rates for the before/after table (name -> value)."""


def task_for(config: Config) -> Task:
    """The task task.name names. "auto": the files' math questions when the config names any
    data, else the built-in chain arithmetic."""
    from grpokit.tasks.registry import task_class

    name, d = config.task.name, config.data
    if name == "auto":
        name = "math" if d.sources or d.sft_sources or d.eval_sources else "chain"
    return task_class(name)(config)


def evaluate_task(task: Task, model, tokenizer, rows: list[dict], config: Config, engine=None,
                  exact_match: bool = False, progress: bool = False, desc: str = "held-out eval") -> EvalResult:
    """Greedy accuracy, pass@k and maj@k on `rows`, graded by the task's rule (or, with
    `exact_match`, by the extracted answer's string equality); with eval.tir, and a task with a
    TIR form, greedy tool-integrated accuracy on the same questions too (result.tir). With
    `progress`, one bar counts every pass over the questions: greedy, k samples, TIR."""
    e = config.eval
    engine = engine or HFEngine(model, tokenizer)
    tir_rows = task.tir_rows(rows, tokenizer) if e.tir else None
    passes = 2 + bool(tir_rows)
    with progress_bar(total=passes * len(rows), desc=f"{desc} ({passes} passes)", unit="question",
                      enabled=progress and distributed.is_main()) as bar:
        result = evaluate(model, tokenizer, rows, task.extract_answer, config.grpo.max_completion_length, k=e.k,
                          temperature=e.temperature, batch_size=e.batch_size, engine=engine,
                          grade=None if exact_match else task.grade, bar=bar)
        if tir_rows:
            result.tir = evaluate_tir(engine, tokenizer, tir_rows, task.tir_answer,
                                      config.grpo.max_completion_length, engine_model_len(engine, config, model),
                                      e.max_tool_calls, e.tool_timeout_s, e.batch_size, bar=bar)
    return result


def engine_model_len(engine, config: Config, model) -> int:
    """The longest context `engine` serves: its own max_model_len (vLLM), else rollout's setting."""
    return getattr(engine, "max_model_len", None) or max_model_len(config.rollout, model)
