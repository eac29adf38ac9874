"""The Task interface and the choice of task from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from grpokit.config import Config
from grpokit.eval import EvalResult, evaluate


@dataclass
class TaskData:
    sft: list[dict]  # {"prompt", "completion"}: demonstrations for pi_SFT (may be empty)
    train: list[dict]  # {"prompt", "answer", ...}: RL questions
    heldout: list[dict]  # {"prompt", "answer", ...}: evaluation questions, never trained on (may be empty)


class Task(Protocol):
    name: str
    # (row, steps) -> [bool]: which step first goes wrong, where a rule can tell; None otherwise
    step_labeller: Callable[[dict, list[str]], list[bool]] | None

    def data(self, tokenizer, sft: bool = True) -> TaskData: ...

    def extract_answer(self, completion: str) -> str | None: ...

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        """Rule-based correctness of each completion against its row's reference."""

    def report(self, result: EvalResult) -> dict[str, float]:
        """Task-specific rates for the before/after table (name -> value)."""


def task_for(config: Config) -> Task:
    """The files' math questions when the config names any data, else the built-in chain arithmetic."""
    d = config.data
    if d.sources or d.sft_sources or d.eval_sources:
        from grpokit.tasks.math import MathTask

        return MathTask(config)
    from grpokit.tasks.chain import ChainTask

    return ChainTask(config)


def evaluate_task(task: Task, model, tokenizer, rows: list[dict], config: Config, engine=None,
                  exact_match: bool = False) -> EvalResult:
    """Greedy accuracy, pass@k and maj@k on `rows`, graded by the task's rule (or, with
    `exact_match`, by the extracted answer's string equality)."""
    e = config.eval
    return evaluate(model, tokenizer, rows, task.extract_answer, config.grpo.max_completion_length, k=e.k,
                    temperature=e.temperature, batch_size=e.batch_size, engine=engine,
                    grade=None if exact_match else task.grade)
