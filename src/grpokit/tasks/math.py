"""GSM8K, MATH and other question/answer files (data.sources), graded by math-verify.

Held-out questions come from data.eval_sources (e.g. a benchmark's test split) when given,
else from a data.heldout_fraction of the questions, split off by a hash of the prompt."""

from __future__ import annotations

import hashlib

from grpokit.config import Config
from grpokit.data.sources import build_rows
from grpokit.rewards import get_reward_function
from grpokit.rewards.answers import extract_final_answer
from grpokit.tasks.base import TaskData
from grpokit.tasks.registry import register_task


def is_heldout(prompt: str, fraction: float) -> bool:
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


@register_task("math")
class MathTask:
    reward = "math_accuracy"
    step_labeller = None  # step labels of free-form solutions come from a file (train-rm --process --data)
    hard_negative = None  # no rule can slip one step of a free-form solution and know the rest

    def __init__(self, config: Config):
        self.data_config = config.data

    def data(self, tokenizer, sft: bool = True) -> TaskData:
        d = self.data_config
        demos = build_rows(d.sft_sources, d, tokenizer, sft=True) if sft and d.sft_sources else []
        train = build_rows(d.sources, d, tokenizer)
        if d.eval_sources:
            heldout = build_rows(d.eval_sources, d, tokenizer)
        else:
            heldout = [r for r in train if is_heldout(r["prompt"], d.heldout_fraction)]
            train = [r for r in train if not is_heldout(r["prompt"], d.heldout_fraction)]
        return TaskData(demos, train, heldout)

    def extract_answer(self, completion: str) -> str | None:
        return extract_final_answer(completion)

    def tir_rows(self, rows: list[dict], tokenizer) -> None:
        """No TIR during training runs: `grpokit eval --mode cot,tir` evaluates a checkpoint both ways."""
        return None

    def tir_answer(self, completion: str) -> str | None:
        return None

    def grade(self, rows: list[dict], completions: list[str]) -> list[bool]:
        scores = get_reward_function("math_accuracy")([r["prompt"] for r in rows], completions,
                                                      answer=[r["answer"] for r in rows])
        return [s is not None and float(s) > 0.5 for s in scores]

    def report(self, result) -> dict[str, float]:
        return {}
