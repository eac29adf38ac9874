"""Per-prompt-mode numbers of a step (task.prompt_modes): reward, each reward function, completion
length and tool calls of the CoT and the TIR samples apart, so a run that mixes them shows which
one is learning. Read from the batch itself (each row's "mode", the rollout's masks), so they
hold after dynamic sampling has merged several generation rounds."""

from __future__ import annotations

import torch

from grpokit.rewards import RewardResult
from grpokit.types import Rollout


def tool_calls_per_sample(rollout: Rollout) -> torch.Tensor:
    """[N] how many tool outputs each completion holds: the runs of non-sampled tokens inside the
    completion (each tool call appends one segment; a single-turn rollout has none)."""
    if rollout.sampled_mask is None:
        return torch.zeros(rollout.num_samples, dtype=torch.long)
    tool = (rollout.completion_mask.bool() & ~rollout.sampled_mask.bool()).long()
    starts = tool[:, :1] + (tool[:, 1:] - tool[:, :-1]).clamp(min=0).sum(1, keepdim=True)
    return starts.squeeze(1).cpu()


def mode_metrics(rollout: Rollout, result: RewardResult) -> dict[str, float]:
    """mode/<mode>/{samples, reward_mean, <reward function>, length_mean, tool_calls_mean} for each
    mode in the rows, when the batch holds more than one mode; nothing otherwise (the step's own
    numbers already say it). Means are over samples with a valid reward (length and calls over all)."""
    modes = [row.get("mode") for row in rollout.rows]
    if len(modes) != rollout.num_samples or len(set(modes)) < 2:
        return {}
    lengths = rollout.completion_lengths.float().cpu()
    calls = tool_calls_per_sample(rollout).float()
    out: dict[str, float] = {}
    for mode in sorted(set(modes), key=str):
        picked = torch.tensor([m == mode for m in modes])
        valid = picked & result.valid.cpu()
        prefix = f"mode/{mode}/"
        out[prefix + "samples"] = int(picked.sum())
        out[prefix + "reward_mean"] = _mean(result.total.cpu()[valid])
        for name, scores in result.per_function.items():
            out[prefix + name] = _mean(scores.cpu()[valid])
        out[prefix + "length_mean"] = _mean(lengths[picked])
        out[prefix + "tool_calls_mean"] = _mean(calls[picked])
    return out


def _mean(values: torch.Tensor) -> float:
    return float(values.double().mean()) if values.numel() else float("nan")
