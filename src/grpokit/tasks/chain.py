"""The demo's task: chain arithmetic ("Q: 7+5-3=?"), graded exactly, with a step checker."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from grpokit.data import arithmetic
from grpokit.data.answers import last_output
from grpokit.tasks.base import TaskData, validation_questions
from grpokit.tasks.registry import register_task

if TYPE_CHECKING:
    from grpokit.config import Config


def _question(row: dict) -> str:
    return row["prompt"].strip().removeprefix("Q:").strip()


def chain_step_labeller(row: dict, steps: list[str]) -> list[bool]:
    """Process labels of the built-in task: which step first goes wrong."""
    return arithmetic.step_labels(_question(row), steps, row["answer"])


def chain_hard_negative(row: dict, completion: str, rng) -> str | None:
    """A right solution with one result slipped and the rest carried on (arithmetic.one_slip)."""
    return arithmetic.one_slip(_question(row), completion, rng)


@register_task("chain")
class ChainTask:
    reward = "chain_accuracy"
    step_labeller = staticmethod(chain_step_labeller)
    hard_negative = staticmethod(chain_hard_negative)

    def __init__(self, config: Config):
        t = config.task
        self.config, self.seed = t, config.seed
        self._said_no_tir = False
        self._writes_programs: dict[int, bool] = {}  # by id(tokenizer): its whole vocabulary is read once
        self.spec = arithmetic.ChainSpec(t.min_ops, t.max_ops, t.max_start, t.max_operand, t.max_value,
                                         t.heldout_percent, t.validation_percent)

    def data(self, tokenizer=None, sft: bool = True) -> TaskData:
        """SFT demonstrations, RL questions (answers only), held-out and validation questions, all
        from seeds (the held-out and validation ones from seed 0 whatever the run's seed)."""
        t, seed = self.config, self.seed
        demos = []
        if sft:  # the TIR demonstrations' questions come after the CoT ones in the same draw
            questions = arithmetic.sample_questions(t.num_sft_examples + t.num_sft_tir_examples, seed, self.spec,
                                                    "train")
            demos = (arithmetic.make_sft_rows(questions[: t.num_sft_examples], t.sft_direct_fraction, seed)
                     + arithmetic.make_tir_rows(questions[t.num_sft_examples :]))
        rl = arithmetic.make_rows(arithmetic.sample_questions(t.num_rl_questions, seed + 1, self.spec, "train"))
        heldout = arithmetic.make_rows(arithmetic.sample_questions(t.num_eval_questions, 0, self.spec, "heldout"))
        validation = arithmetic.make_rows(validation_questions(
            lambda n: arithmetic.sample_questions(n, 0, self.spec, "validation"), t))
        return TaskData([{"prompt": r["prompt"], "completion": r["solution"]} for r in demos],
                        [{k: r[k] for k in ("prompt", "question", "answer")} for r in rl], heldout, validation)

    def extract_answer(self, completion: str) -> str | None:
        return arithmetic.extract_answer(completion)

    def prompt(self, row: dict, mode: str, tokenizer) -> str | None:
        """"Q: 7+5-3\n" (cot), or the same question asking for a program (tir); None for tir
        when `tokenizer` cannot write a program."""
        if mode == "tir":
            return arithmetic.format_tir_prompt(row["question"]) if self._can_write_programs(tokenizer) else None
        return arithmetic.format_prompt(row["question"])

    def tir_rows(self, rows: list[dict], tokenizer) -> list[dict] | None:
        """`rows` with tool-integrated prompts; None (said once) when `tokenizer` cannot write a
        program, e.g. a model built with model.tiny.alphabet=arithmetic."""
        if not self._can_write_programs(tokenizer):
            return None
        return [{**row, "prompt": self.prompt(row, "tir", tokenizer)} for row in rows]

    def _can_write_programs(self, tokenizer) -> bool:
        known = self._writes_programs.get(id(tokenizer))
        if known is not None:
            return known
        missing = sorted(set(arithmetic.TIR_ALPHABET) - set(tokenizer.get_vocab()))
        self._writes_programs[id(tokenizer)] = not missing
        if missing and not self._said_no_tir:
            print(f"grpokit: no TIR evaluation: the tokenizer has no {''.join(missing)!r}, which the task's "
                  "python programs need (model.tiny.alphabet=arithmetic-tir has them)", file=sys.stderr)
            self._said_no_tir = True
        return not missing

    def tir_answer(self, completion: str) -> str | None:
        """The "A: n" line, else the last program output (a rollout cut at its tool-call limit)."""
        stated = arithmetic.extract_answer(completion)
        return stated if stated is not None else last_output(completion)

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        scores = arithmetic.chain_accuracy([r["prompt"] for r in rows], completions, [r["answer"] for r in rows])
        return [s > 0.5 for s in scores]

    def report(self, result) -> dict[str, float]:
        """Greedy held-out rates by answer form: shows its steps, right if worked, right if direct."""
        return arithmetic.worked_rates(result.greedy_completions, result.greedy_correct)
