"""GSM8K, MATH and other question/answer files (data.sources), graded by math-verify.

One rule, used by the RL reward, by a run's held-out evaluation and by `grpokit eval`:
- the prompt: the question under data.template (DeepSeekMath's CoT instruction by default; its
  TIR instruction in tir mode), in the tokenizer's chat template or data.plain_layout;
- the answer: the last non-empty \\boxed{}, else the last ```output block (a TIR rollout cut at
  its tool-call limit ends on one), else the last answer stated as "#### x", "The answer is x"
  or "A: x";
- correct: as the math_accuracy reward judges it (every distinct final answer the completion
  states is math-verify-equivalent to the reference, so hedging never passes); a completion that
  states none is judged on its last program output.

Held-out questions come from data.eval_sources (e.g. a benchmark's test split) when given,
else from a data.heldout_fraction of the questions, split off by grpokit.data.split's hash of
the question; the next data.validation_fraction of them, by the same hash, are the validation
questions, on which settings are chosen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from grpokit.data.answers import final_answer, final_answers, last_output
from grpokit.data.sources import build_rows
from grpokit.data.split import split_of
from grpokit.data.templates import render_prompt
from grpokit.rewards.math_rewards import math_accuracy
from grpokit.tasks.base import TaskData
from grpokit.tasks.registry import register_task

if TYPE_CHECKING:
    from grpokit.config import Config


def extract_answer(completion: str) -> str | None:
    """The last non-empty \\boxed{}, else the last ```output block, else the last answer stated
    as "#### x", "The answer is x" or "A: x"; None when there is none."""
    answer = final_answer(completion)
    if answer is None:
        stated = final_answers(completion)
        answer = stated[-1] if stated else None
    return answer


def grade_answers(answers: Sequence[str | None], references: Sequence[str]) -> list[bool]:
    """Whether each answer is equivalent to its reference, by grpokit's math_accuracy reward
    (math-verify). The answer goes in boxed, so only it is judged."""
    completions = ["" if a is None else f"\\boxed{{{a}}}" for a in answers]
    scores = math_accuracy([""] * len(completions), completions, list(references))
    return [s > 0.5 for s in scores]


def grade(completions: Sequence[str], references: Sequence[str]) -> list[bool]:
    """The math task's correctness: the math_accuracy reward of each completion, or, for one that
    states no final answer, of its last program output."""
    scores = math_accuracy([""] * len(completions), list(completions), [str(r) for r in references])
    correct = [s is not None and float(s) > 0.5 for s in scores]
    unstated = [i for i, c in enumerate(completions) if not final_answers(c) and last_output(c) is not None]
    outputs = grade_answers([last_output(completions[i]) for i in unstated], [references[i] for i in unstated])
    for i, ok in zip(unstated, outputs):
        correct[i] = ok
    return correct


@register_task("math")
class MathTask:
    reward = "math_accuracy"
    step_labeller = None  # step labels of free-form solutions come from a file (train-rm --process --data)
    hard_negative = None  # no rule can slip one step of a free-form solution and know the rest
    extract_answer = staticmethod(extract_answer)
    tir_answer = staticmethod(extract_answer)

    def __init__(self, config: Config):
        self.data_config = config.data

    def data(self, tokenizer, sft: bool = True) -> TaskData:
        d = self.data_config
        demos = build_rows(d.sft_sources, d, tokenizer, sft=True) if sft and d.sft_sources else []
        train = build_rows(d.sources, d, tokenizer)
        # eval_sources hold the held-out questions: the sources' hash then only splits off validation
        held = 0.0 if d.eval_sources else d.heldout_fraction
        sides = [split_of(r["question"], held, d.validation_fraction) for r in train]
        heldout = build_rows(d.eval_sources, d, tokenizer) if d.eval_sources else \
            [r for r, side in zip(train, sides) if side == "heldout"]
        validation = [r for r, side in zip(train, sides) if side == "validation"]
        return TaskData(demos, [r for r, side in zip(train, sides) if side == "train"], heldout, validation)

    def prompt(self, row: dict, mode: str, tokenizer) -> str:
        """The row's question as the policy reads it: data.template (cot) or DeepSeekMath's TIR
        instruction (tir), in the chat template or data.plain_layout."""
        d = self.data_config
        return render_prompt(row["question"], tokenizer, d.template if mode == "cot" else "tir", d.chat_template,
                             d.system_prompt, d.plain_layout)

    def tir_rows(self, rows: list[dict], tokenizer) -> None:
        """No TIR during training runs: `grpokit eval --mode cot,tir` evaluates a checkpoint both ways."""
        return None

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        return grade(completions, [r["answer"] for r in rows])

    def report(self, result) -> dict[str, float]:
        return {}
