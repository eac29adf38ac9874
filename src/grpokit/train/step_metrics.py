"""A training step's row of metrics.jsonl (docs/reference/metrics.md), and the warning for a run
whose reward has stopped varying."""

from __future__ import annotations

import torch

from grpokit import distributed
from grpokit.rewards import RewardResult
from grpokit.train.mode_metrics import MODES, mode_metrics
from grpokit.types import Rollout

# Metrics rows are means over processes, except these, which add up or take the maximum.
SUMMED_METRICS = ("rewards/failed", "rewards/timeouts", "perf/tokens_per_s")
# mode/*/samples are already the whole batch's (mode_metrics sums them): the max keeps them, as integers
MAXED_METRICS = tuple(f"mode/{mode}/samples" for mode in MODES) + (
    "completion/max_length", "skipped_updates", "perf/step_time_s", "perf/rollout_time_s", "perf/scoring_time_s",
    "perf/logprob_time_s", "perf/update_time_s", "rollout/sync_time_s")

# Steps in a row with no reward spread in any group before the run warns. A step like that happens by
# chance (a small batch of questions the policy always gets right); five in a row rarely does unless
# the reward cannot vary, and five steps are seconds to minutes, early enough to stop a doomed run.
NO_SIGNAL_STEPS = 5


def zero_std_fraction(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> float:
    """Share of groups whose valid rewards are all equal: they get zero advantage."""
    r = torch.where(valid, rewards, torch.nan).view(-1, group_size)
    spread = torch.nan_to_num(r.nan_to_num(-torch.inf).amax(1) - r.nan_to_num(torch.inf).amin(1), nan=0.0)
    return float(((spread <= 0) | (valid.view(-1, group_size).sum(1) < 2)).float().mean())


def no_signal_warning(history: list[dict], steps: int = NO_SIGNAL_STEPS) -> str | None:
    """The warning for a run whose last `steps` metrics rows all had reward/zero_std_frac = 1 (in
    every group all completions got the same reward, so the reward gives nothing to learn from);
    None otherwise."""
    recent = history[-steps:]
    if len(recent) < steps or not all(row.get("reward/zero_std_frac", 0.0) >= 1.0 for row in recent):
        return None
    still = " and grad_norm = 0" if all(row.get("grad_norm") == 0.0 for row in recent) else ""
    return (f"grpokit: warning: reward/zero_std_frac = 1.0{still} in {steps} steps in a row (through step "
            f"{recent[-1].get('step')}): in every group all completions got the same reward, so the reward gives "
            "nothing to learn from. This usually means a reward that never varies, a model that is always right or "
            "always wrong on these questions, or a broken verifier; rewards/<name> in metrics.jsonl shows which")


def step_record(step: int, rollout: Rollout, result: RewardResult, group_size: int, seconds: float,
                sections: dict) -> dict:
    """The step's metrics row, reduced over processes: rewards, completion lengths and throughput, then
    `sections` in order (the update's stats, the sampler's, the timings, the learning rate, ...)."""
    lengths = rollout.completion_lengths.float()
    valid_total = result.total[result.valid]
    record = {
        "step": step,
        "reward/mean": float(valid_total.mean()) if valid_total.numel() else float("nan"),
        "reward/std": float(valid_total.std()) if valid_total.numel() > 1 else 0.0,
        "reward/zero_std_frac": zero_std_fraction(result.total, result.valid, group_size),
        **{f"rewards/{name}": mean for name, mean in result.function_means().items()},
        "rewards/failed": int((~result.valid).sum()),
        "rewards/timeouts": sum(result.timeouts.values()),
        **result.logged,  # what reward functions logged (TRL's log_metric, log_extra)
        **sections["update"],
        **sections["sampling"],
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": int(lengths.max()),
        "completion/truncated_frac": float(rollout.truncated.float().mean()),
        **mode_metrics(rollout, result),
        "perf/tokens_per_s": float(lengths.sum()) / seconds,
        "perf/step_time_s": seconds,
        **sections["perf"],
    }
    return distributed.reduce_metrics(record, SUMMED_METRICS, MAXED_METRICS)
