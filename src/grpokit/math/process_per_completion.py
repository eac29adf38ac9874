"""Eq. 6 normalised per completion (`grpo.process_advantage: per_completion`): the sum over the
steps at or after each token, divided by the completion's number of steps K_i,

    A_{i,t} = (1 / K_i) sum_{index(j) >= t} r~_i^{index(j)},

so a solution of many steps no longer weighs more than a short one: at its first token every
completion carries the mean of its normalised step rewards instead of their sum. r~ is eq. 6's
normalisation over all steps of the group.
"""

from __future__ import annotations

import torch

from grpokit.math.advantages import check_step_rewards, normalised_step_rewards, summed_after
from grpokit.math.registry import register_process_advantage


@register_process_advantage("per_completion")
def per_completion_advantages(step_rewards, step_ends, num_tokens, group_size) -> torch.Tensor:
    """Eq. 6's token advantages of each completion divided by its number of steps."""
    steps = check_step_rewards(step_rewards, step_ends, num_tokens, group_size)
    summed = summed_after(steps, normalised_step_rewards(steps))
    counts = torch.tensor([max(1, e.numel()) for e in steps.ends], dtype=torch.float64).unsqueeze(1)
    return steps.finish(summed / counts)
