"""RLOO's leave-one-out baseline (Ahmadian et al. 2024, arXiv:2402.14740) as an outcome advantage
estimator (`grpo.advantage: rloo`): each sample is compared with the mean of the other valid
samples of its group,

    A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_j r_j),   n = valid samples in the group,

an unbiased baseline (it does not depend on r_i). No std scaling, so grpo.scale_rewards has no
effect. Invalid samples get 0 and are left out of the mean; a group with fewer than 2 valid
samples gets 0.
"""

from __future__ import annotations

import torch

from grpokit.math.advantages import masked_outcome_advantages
from grpokit.math.registry import register_advantage


@register_advantage("rloo")
def leave_one_out(rewards: torch.Tensor, valid: torch.Tensor, group_size: int, scale: bool = False) -> torch.Tensor:
    """r_i minus the mean of the other valid rewards of its group (RLOO)."""
    centred = masked_outcome_advantages(rewards, valid, group_size, scale=False)  # r_i - mean, checks the shapes
    n_valid = valid.to(torch.bool).view(-1, group_size).sum(dim=1, keepdim=True).to(centred.dtype)
    factor = (n_valid / (n_valid - 1).clamp(min=1)).expand(-1, group_size).reshape(-1)
    return centred * factor
