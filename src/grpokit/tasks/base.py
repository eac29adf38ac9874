"""The Task interface, and the prompt modes of a task's rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from grpokit.data.split import heldout_position
from grpokit.errors import ConfigError


@dataclass
class TaskData:
    sft: list[dict]  # {"prompt", "completion"}: demonstrations for pi_SFT (may be empty)
    train: list[dict]  # {"prompt", "answer", ...}: RL questions
    heldout: list[dict]  # {"prompt", "answer", ...}: evaluation questions, never trained on (may be empty)
    # {"prompt", "answer", ...}: questions to choose settings on, disjoint from both by the same hash (may be empty)
    validation: list[dict] = field(default_factory=list)


class Task(Protocol):
    name: str  # what task.name calls it (register_task sets it)
    # the reward that grades it in RL (a rewards[].name); a named task's replaces the default rewards; None if none
    reward: str | None
    # (row, steps) -> [bool]: which step first goes wrong, where a rule can tell; None otherwise
    step_labeller: Callable[[dict, list[str]], list[bool]] | None
    # (row, right completion, rng) -> the same solution with one slip (a hard negative); None where no rule can make one
    hard_negative: Callable[[dict, str, object], str | None] | None

    def data(self, tokenizer, sft: bool = True) -> TaskData: ...

    # Optional: prompt(row, mode, tokenizer) -> str | None, the prompt of a held-out row in mode
    # "cot" or "tir" (None: the task has no such form). `grpokit eval` renders a question file
    # with it; a task without it is evaluated on the prompts its rows carry.

    def extract_answer(self, completion: str) -> str | None: ...

    def tir_rows(self, rows: list[dict], tokenizer) -> list[dict] | None:
        """`rows` with tool-integrated prompts, or None when the task (or tokenizer) has no TIR form."""

    def tir_answer(self, completion: str) -> str | None: ...

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        """Rule-based correctness of each completion against its row's reference."""

    def report(self, result) -> dict[str, float]:
        """Task-specific rates for the before/after table (name -> value)."""


def with_prompt_modes(task: Task, rows: list[dict], modes: dict[str, float], tokenizer) -> list[dict]:
    """`rows` in the shares of task.prompt_modes: a fixed hash of each question decides its mode,
    and a "tir" row gets the task's tool-integrated prompt and mode "tir" (a "cot" row keeps its
    prompt, and mode "cot"). All-cot shares leave the rows as they are."""
    tir_share = modes.get("tir", 0) / sum(modes.values())
    if tir_share == 0:
        return rows
    tir_prompt = getattr(task, "prompt", None)
    out = []
    for row in rows:
        if heldout_position(f"prompt-mode/{row.get('question', row['prompt'])}") >= tir_share:
            out.append({**row, "mode": "cot"})
            continue
        prompt = tir_prompt(row, "tir", tokenizer) if tir_prompt is not None else None
        if prompt is None:
            raise ConfigError(f"task.prompt_modes gives tir a share, but task {task.name!r} has no tool-integrated "
                              f"prompt here (a tokenizer that cannot spell programs, or a task without a TIR form): "
                              f"set task.prompt_modes to {{cot: 1.0}}")
        out.append({**row, "prompt": prompt, "mode": "tir"})
    return out


def validation_questions(draw: Callable[[int], list], task_config) -> list:
    """task.num_validation_questions questions of a drawn task's validation share, at most as many as
    task.num_eval_questions (a run that evaluates few held-out questions stays as cheap on validation),
    `draw(n)` drawing them (none when either key is 0); one line naming the keys and the sizes when
    the share holds fewer distinct questions than asked for."""
    asked, percent = task_config.num_validation_questions, task_config.validation_percent
    n = min(asked, task_config.num_eval_questions)
    if not (n and percent):
        return []
    try:
        return draw(n)
    except ValueError as error:
        found = getattr(error, "found", None)
        raise ConfigError(f"task.num_validation_questions={asked} asks for more validation questions than "
                          f"task.validation_percent={percent} holds"
                          + (f" ({found} distinct ones drawn)" if found is not None else "")
                          + ": lower task.num_validation_questions or raise task.validation_percent") from None
