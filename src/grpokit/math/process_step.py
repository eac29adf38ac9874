"""Process advantages without eq. 6's sum (`grpo.process_advantage: step`): each token gets the
group-normalised reward of its own step only,

    A_{i,t} = r~_i^{index(j)}   for the step j that holds token t (index(j-1) < t <= index(j)),

so a token is judged by its own step, and a long solution's early tokens do not collect the credit
(or blame) of every later step. r~ is eq. 6's normalisation over all steps of the group. Tokens after
a completion's last step end get 0 (eq. 6 gives them 0 too).
"""

from __future__ import annotations

import torch

from grpokit.math.advantages import check_step_rewards, normalised_step_rewards
from grpokit.math.registry import register_process_advantage


@register_process_advantage("step")
def own_step_advantages(step_rewards, step_ends, num_tokens, group_size) -> torch.Tensor:
    """Each token's advantage is the normalised reward of the step it belongs to."""
    steps = check_step_rewards(step_rewards, step_ends, num_tokens, group_size)
    out = steps.empty()
    for i, (values, ends) in enumerate(zip(normalised_step_rewards(steps), steps.ends)):
        start = 0
        for value, end in zip(values.tolist(), ends.tolist()):
            out[i, start : end + 1] = value  # two steps ending at one token: the later one's tokens are none
            start = max(start, end + 1)
    return steps.finish(out)
