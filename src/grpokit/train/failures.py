"""When a run stops itself: a reward function failing every sample, every rollout failing, or a
non-finite loss, each for too many steps in a row. A single bad step is survived (its samples get no
reward, or its update is skipped); a streak means something is broken, so the run stops and says what."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from grpokit import distributed
from grpokit.rewards import RewardResult
from grpokit.types import Rollout


class RewardFailure(RuntimeError):
    """A reward function failed on every sample for too many consecutive steps."""


class NonFiniteTraining(FloatingPointError):
    """The loss or gradients were NaN/inf for too many consecutive steps."""


def drop_failed_rollouts(rollout: Rollout, result: RewardResult) -> None:
    """Samples whose rollout failed (Rollout.failed: a tool raised in the harness) get no reward,
    so no advantage and no place in the loss, and the run goes on."""
    if rollout.failed is not None and rollout.failed.any():
        failed = rollout.failed.cpu()
        result.valid = result.valid & ~failed
        result.total = torch.where(failed, torch.nan, result.total)


class FailureStreaks:
    """Consecutive failed steps of each kind; `max_failed` (grpo.max_failed_steps) for rewards and
    rollouts, `max_nonfinite` (grpo.max_nonfinite_steps) for updates. Every process counts alike."""

    def __init__(self, reward_names: list[str], max_failed: int, max_nonfinite: int):
        self.rewards = {name: 0 for name in reward_names}
        self.rollouts = 0
        self.nonfinite = 0
        self.max_failed, self.max_nonfinite = max_failed, max_nonfinite

    def count_rewards(self, result: RewardResult) -> None:
        """A reward function that failed on every sample of the step, on every process, adds to its streak."""
        local_failures = set(result.all_failed())
        failed_everywhere = {name for name in self.rewards if distributed.all_agree(name in local_failures)}
        for name in self.rewards:
            self.rewards[name] = self.rewards[name] + 1 if name in failed_everywhere else 0
            if self.rewards[name] >= self.max_failed:
                raise RewardFailure(
                    f"reward function {name!r} failed on every sample for {self.rewards[name]} "
                    f"consecutive steps (last error: {result.errors.get(name)}); fix it or remove it from `rewards`"
                )

    def count_rollouts(self, rollout: Rollout, what_failed) -> None:
        """After max_failed steps in which every sample of the step (all generation rounds, every
        process) failed its rollout, stop, saying what failed (what_failed() -> str)."""
        everything = distributed.all_agree(rollout.failed is not None and bool(rollout.failed.all()))
        self.rollouts = self.rollouts + 1 if everything else 0
        if self.rollouts >= self.max_failed:
            what = what_failed() or "the rollout engine failed every sample"
            raise RewardFailure(f"every rollout failed for {self.rollouts} consecutive steps: {what}; "
                                "fix it, or run without rollout.tool")

    def count_updates(self, skipped: int, step: int, last_checkpoint: Callable[[], Path | None]) -> None:
        """A step whose updates were skipped (NaN/inf) adds to the streak; too many stop the run."""
        self.nonfinite = self.nonfinite + 1 if skipped else 0
        if self.nonfinite >= self.max_nonfinite:
            raise NonFiniteTraining(
                f"the loss or gradient norm was NaN/inf in {self.nonfinite} consecutive steps "
                f"(through step {step}); every such update was skipped, so the weights are still "
                f"finite. Last good checkpoint: {last_checkpoint() or 'none yet'}. Lower grpo.learning_rate or check "
                "the data."
            )

    def state_dict(self) -> dict:
        return {"failed_streak": dict(self.rewards), "failed_rollout_streak": self.rollouts,
                "nonfinite_streak": self.nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self.rewards.update(state["failed_streak"])
        self.rollouts = int(state.get("failed_rollout_streak", 0))  # absent before tool rollouts
        self.nonfinite = int(state["nonfinite_streak"])
