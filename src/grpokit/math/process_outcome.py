"""Process and outcome supervision mixed (`grpo.process_advantage: process_outcome`): eq. 6 plus
eq. 5 of each completion's last step reward, its verdict on the outcome,

    A_{i,t} = sum_{index(j) >= t} r~_i^{index(j)}  +  (r_i^{last} - mean(r^{last})) / (std(r^{last}) + eps),

the second term over the group's completions that have steps (unbiased std, eps = 1e-4, 0 for an
all-equal group, as eq. 5). The step rule then also says, once per completion, whether the answer
was reached: for the built-in step checkers the last step is the answer step. (Listing an outcome
reward such as chain_accuracy beside a process reward mixes the two the same way, with that
function's verdict as the outcome.)
"""

from __future__ import annotations

import torch

from grpokit.math.advantages import (
    check_step_rewards,
    masked_outcome_advantages,
    normalised_step_rewards,
    summed_after,
)
from grpokit.math.registry import register_process_advantage


@register_process_advantage("process_outcome")
def process_plus_outcome(step_rewards, step_ends, num_tokens, group_size) -> torch.Tensor:
    """Eq. 6 plus the eq. 5 advantage of the last step's reward, the same for every token of a completion."""
    steps = check_step_rewards(step_rewards, step_ends, num_tokens, group_size)
    process = summed_after(steps, normalised_step_rewards(steps))
    has_steps = torch.tensor([r.numel() > 0 for r in steps.rewards])
    last = torch.tensor([float(r[-1]) if r.numel() else 0.0 for r in steps.rewards], dtype=torch.float64)
    outcome = masked_outcome_advantages(last, has_steps, steps.group_size)
    return steps.finish(process + outcome.unsqueeze(1))
