"""Iterative GRPO (docs/algorithm.md, Algorithm 1): the reward model follows the policy.

    for iteration k = 1..K:
        pi_ref <- pi_theta
        GRPO for S steps
        sample from the new pi_theta, label by rule, train the reward model further on the new
        data plus a replay buffer holding 10% of the historical data

Each boundary writes iterations/iter-k/ with the policy (a full, resumable trainer checkpoint),
the reward model, the replay buffer and state.json; a run resumes from the last complete one.
The last iteration skips the refresh: no GRPO step would use the refreshed model.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from grpokit.run.checkpoint import save_checkpoint
from grpokit.config import IterativeConfig, RewardModelConfig
from grpokit.data.reward_data import write_jsonl
from grpokit.rewards.learned import save_reward_model
from grpokit.rewards.scorers import scorer_info
from grpokit.rollout import HFEngine
from grpokit.train.reward_model import (
    ReplayBuffer,
    RewardModelDataError,
    build_examples,
    evaluate_reward_model,
    example_record,
    fit_reward_model,
    hard_negative_examples,
    rollout_step_examples,
    sample_completions,
    split_by_prompt,
)

STATE_FILE = "state.json"


@dataclass
class RewardModelStage:
    """Trains (and retrains) the reward model that `scorer` wraps, on graded policy samples.

    rows: questions to sample from (each with what `grade` needs); every round takes the next
    config.data.num_questions of them, so each round sees fresh questions."""

    scorer: object
    tokenizer: object
    config: RewardModelConfig
    rows: list[dict]
    grade: Callable[[list[dict], list[str]], list[bool]]
    step_labeller: Callable | None
    max_new_tokens: int
    run_dir: Path
    seed: int = 0
    progress: bool = True
    engine: object = None  # the policy's rollout engine; None: transformers' generate on the policy given
    hard_negative: Callable | None = None  # the task's one-slip twin maker (reward_model.data.hard_negatives)
    replay_fraction: float = IterativeConfig().replay_fraction  # iterative.replay_fraction

    def __post_init__(self) -> None:
        self.buffer = ReplayBuffer(self.run_dir / "replay_buffer.jsonl", self.replay_fraction, self.seed)

    @property
    def kind(self) -> str:
        return self.scorer.kind

    def _questions(self, round_index: int) -> list[dict]:
        n = self.config.data.num_questions
        start = (round_index * n) % max(1, len(self.rows))
        return (self.rows[start:] + self.rows[:start])[:n]

    def train_round(self, policy, round_index: int) -> dict:
        """Sample from `policy`, label, fit on new data (+ the replay buffer), evaluate on held-out
        questions of this round, add to the buffer. Round 0 trains the initial reward model."""
        cfg = self.config
        engine = self.engine or HFEngine(policy, self.tokenizer)
        rows, completions = sample_completions(engine, self._questions(round_index), cfg,
                                               self.max_new_tokens, progress=self.progress)
        if self.kind == "process" and cfg.label.method == "rollouts":
            examples, _ = rollout_step_examples(engine, rows, completions, self.grade, cfg, self.max_new_tokens)
        else:
            examples = build_examples(self.kind, rows, completions, self.grade, self.step_labeller, cfg,
                                      self.seed + round_index)
        # Kept for inspection and reuse: `grpokit train-rm --data` reads this file as it is.
        write_jsonl(self.run_dir / "reward_model_data" / f"round-{round_index}.jsonl",
                    [example_record(x) for x in examples])
        if not examples and not self.buffer.items:
            correct = sum(self.grade(rows, completions))
            raise RewardModelDataError(
                f"no reward-model training data: of {len(completions)} policy samples {correct} were correct, and "
                f"no question had both a correct and an incorrect one to pair. Sample more "
                f"(reward_model.data.num_questions, reward_model.data.samples_per_question), raise "
                f"reward_model.data.temperature, or start from a better-trained policy")
        train, heldout = split_by_prompt(examples, cfg.train.heldout_fraction, self.seed + round_index)
        if cfg.data.hard_negatives:  # training questions only: held-out accuracy stays on real samples
            heldout_prompts = {x.prompt for x in heldout}
            kept = [(r, c) for r, c in zip(rows, completions) if r["prompt"] not in heldout_prompts]
            train += hard_negative_examples(self.kind, [r for r, _ in kept], [c for _, c in kept],
                                            self.hard_negative, self.step_labeller, cfg, self.seed + round_index)
        # The drift the refresh is for: the reward model as it stands, on the new policy's held-out samples.
        before = {"before_refresh": evaluate_reward_model(self.scorer, heldout)} if round_index > 0 else {}
        replay = list(self.buffer.items)
        desc = "reward model" if round_index == 0 else f"reward model, refresh {round_index}"
        losses = fit_reward_model(self.scorer, train + replay, cfg, seed=self.seed + round_index,
                                  progress=self.progress, desc=desc)
        metrics = {"round": round_index, "samples": len(completions), "new_examples": len(train),
                   "replay_examples": len(replay), "heldout_examples": len(heldout),
                   "final_loss": losses[-1], **evaluate_reward_model(self.scorer, heldout), **before}
        self.buffer.add(train, round_index)
        with (self.run_dir / "reward_model_metrics.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        return metrics

    def save(self, path: Path, metrics: dict | None = None) -> Path:
        info = scorer_info(self.scorer, self.config.step_delimiter)
        return save_reward_model(self.scorer.model, self.scorer.tokenizer, info, path, metrics)


def iteration_boundaries(total_steps: int, iterations: int) -> list[int]:
    """The global step at which each iteration ends: total_steps split as evenly as possible."""
    return [round(total_steps * (k + 1) / iterations) for k in range(iterations)]


def run_iterations(trainer, stage: RewardModelStage | None, iterations: int, start: int = 1) -> list[dict]:
    """Iterations start..K of Algorithm 1 on `trainer`; returns the GRPO metrics rows."""
    boundaries = iteration_boundaries(trainer.config.max_steps, iterations)
    history = []
    for k in range(start, iterations + 1):
        if k > 1:  # iteration 1's reference is the initial policy already (also on a resume inside it)
            trainer.reset_reference()
        extra = {"iteration": k} if iterations > 1 else None
        history += trainer.train(until=boundaries[k - 1], extra_metrics=extra)
        if trainer.interrupted or k == iterations:
            break
        metrics = stage.train_round(trainer.model, k)
        print(f"iteration {k}: reward model refreshed on {metrics['new_examples']} new + "
              f"{metrics['replay_examples']} replayed examples; held-out {rm_headline(metrics)}; before the refresh, "
              f"{rm_headline(metrics['before_refresh'])}", file=sys.stderr)
        save_iteration(trainer, stage, k)
    return history


def rm_headline(metrics: dict) -> str:
    """A reward model's held-out accuracy in words."""
    if "pairwise_accuracy" in metrics:
        return f"pairwise accuracy {metrics['pairwise_accuracy']:.1%} on {metrics['pairs']} pairs"
    if "step_accuracy" in metrics:
        return (f"step accuracy {metrics['step_accuracy']:.1%} on {metrics['steps']} steps "
                f"(right steps {metrics['step_accuracy_on_right_steps']:.1%}, "
                f"wrong steps {metrics['step_accuracy_on_wrong_steps']:.1%})")
    return "not measured (no held-out examples; raise reward_model.data.num_questions)"


def save_iteration(trainer, stage: RewardModelStage, k: int) -> Path:
    """iterations/iter-k: policy + trainer state, reward model, replay buffer; state.json last,
    so a directory without it is an incomplete boundary and is ignored on resume."""
    directory = trainer.run_dir / "iterations" / f"iter-{k}"
    directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(trainer.model, trainer.tokenizer, directory / "policy", extra=trainer._write_extra_files,
                    rank_extra=trainer._write_rank_state)
    stage.save(directory / "reward_model")
    shutil.copyfile(stage.buffer.path, directory / "replay_buffer.jsonl")
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps({"iteration": k, "global_step": trainer.global_step}))
    tmp.replace(directory / STATE_FILE)
    return directory


def latest_iteration(run_dir: str | Path) -> Path | None:
    """The newest iterations/iter-k with a state.json, or None."""
    done = [d for d in (Path(run_dir) / "iterations").glob("iter-*") if (d / STATE_FILE).is_file()]
    return max(done, key=lambda d: int(d.name.split("-")[1]), default=None)
