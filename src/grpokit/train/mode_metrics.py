"""Per-prompt-mode numbers of a step (task.prompt_modes): reward, each reward function, completion
length and tool calls of the CoT and the TIR samples apart, so a run that mixes them shows which
one is learning. Read from the batch itself (each row's "mode", the rollout's masks), so they
hold after dynamic sampling has merged several generation rounds, and summed over processes
before they are divided, so under torchrun they are the whole batch's."""

from __future__ import annotations

import math

import torch

from grpokit import distributed
from grpokit.rewards import RewardResult
from grpokit.types import Rollout

MODES = ("cot", "tir")  # what tasks.base.with_prompt_modes writes in a row's "mode"


def tool_calls_per_sample(rollout: Rollout) -> torch.Tensor:
    """[N] how many tool outputs each completion holds: the runs of non-sampled tokens inside the
    completion (each tool call appends one segment; a single-turn rollout has none)."""
    if rollout.sampled_mask is None:
        return torch.zeros(rollout.num_samples, dtype=torch.long)
    tool = (rollout.completion_mask.bool() & ~rollout.sampled_mask.bool()).long()
    starts = tool[:, :1] + (tool[:, 1:] - tool[:, :-1]).clamp(min=0).sum(1, keepdim=True)
    return starts.squeeze(1).cpu()


def mode_metrics(rollout: Rollout, result: RewardResult) -> dict[str, float]:
    """mode/<mode>/{samples, reward_mean, <reward function>, length_mean, tool_calls_mean} for cot
    and tir when the rows carry a mode (a mixed run: every row does, on every process); nothing
    otherwise. Means are over samples with a valid reward (length and calls over all); a mode with
    no sample in the batch has NaN means."""
    if not rollout.rows or "mode" not in rollout.rows[0]:
        return {}
    modes = [row["mode"] for row in rollout.rows]
    lengths = rollout.completion_lengths.double().cpu()
    calls = tool_calls_per_sample(rollout).double()
    valid, total = result.valid.cpu(), result.total.cpu().double()
    sums: dict[str, float] = {}
    for mode in MODES:
        picked = torch.tensor([m == mode for m in modes])
        scored = picked & valid
        sums[f"{mode}/samples"] = float(picked.sum())
        sums[f"{mode}/valid"] = float(scored.sum())
        sums[f"{mode}/reward_mean"] = float(total[scored].sum())
        for name, scores in result.per_function.items():
            sums[f"{mode}/{name}"] = float(scores.cpu().double()[scored].sum())
        sums[f"{mode}/length_mean"] = float(lengths[picked].sum())
        sums[f"{mode}/tool_calls_mean"] = float(calls[picked].sum())
    sums = distributed.sum_dict(sums)  # the same keys on every process: both modes, every reward
    out: dict[str, float] = {}
    for mode in MODES:
        n, scored = sums[f"{mode}/samples"], sums[f"{mode}/valid"]
        out[f"mode/{mode}/samples"] = int(n)
        for key, value in sums.items():
            if key.startswith(f"{mode}/") and key not in (f"{mode}/samples", f"{mode}/valid"):
                count = n if key.endswith(("/length_mean", "/tool_calls_mean")) else scored
                out[f"mode/{key}"] = value / count if count else math.nan
    return out
