"""Validation accuracy: greedy accuracy on the task's validation questions, the split that settings
(presets, levers, defaults) are chosen on, so that the held-out numbers a run reports were never
chosen on. Greedy only, to stay cheap; it draws nothing from the run's random streams."""

from __future__ import annotations

import time

import torch

from grpokit import distributed
from grpokit.config import Config
from grpokit.data.files import DatasetError, filter_long_prompts
from grpokit.eval.evaluate import evaluate
from grpokit.rollout.engine import evaluation_engine


def validation_accuracy(task, model, tokenizer, rows: list[dict], config: Config, engine) -> dict:
    """{"questions", "greedy_accuracy", "seconds"} of greedy completions of `rows` (the task's
    validation questions within data.max_prompt_length), graded by the task's rule; {} without any."""
    try:
        rows, _ = filter_long_prompts(rows, tokenizer, config.data.max_prompt_length, "skip", "validation questions")
    except DatasetError:  # none is short enough
        rows = []
    if not rows:
        return {}
    started = time.perf_counter()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the run trains as it would without it
        result = evaluate(model, tokenizer, rows, task.extract_answer, config.grpo.max_completion_length, k=0,
                          batch_size=config.eval.batch_size, engine=evaluation_engine(engine), grade=task.grade)
    return {"questions": result.num_questions, "greedy_accuracy": result.greedy_accuracy,
            "seconds": time.perf_counter() - started}


def validation_summary(before: dict | None, after: dict) -> dict:
    """summary.json's "validation": the greedy accuracy before and after RL on the same questions,
    and the change in points; {} where there were none."""
    if not after:
        return {}
    out = {"questions": after["questions"], "after": after["greedy_accuracy"], "before": None,
           "change_points": None, "seconds": after["seconds"] + (before or {}).get("seconds", 0.0)}
    if before:
        out.update(before=before["greedy_accuracy"],
                   change_points=100 * (after["greedy_accuracy"] - before["greedy_accuracy"]))
    shown = f"{out['before']:.1%} -> " if before else ""
    if distributed.is_main():  # every process evaluated the same questions
        print(f"validation ({out['questions']} questions, what settings are chosen on): greedy {shown}{out['after']:.1%}")
    return {"validation": out}
