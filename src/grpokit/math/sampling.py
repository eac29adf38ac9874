"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476): which groups can teach.

A group whose valid rewards are all equal has advantage 0 on every sample (eq. 5), so it
contributes no policy gradient. With dynamic sampling on, the trainer drops such groups
and samples fresh questions until the step holds enough groups with a spread.
Shapes: N = prompts x G completions, groups contiguous. Pure tensor code: no models, no I/O.
"""

from __future__ import annotations

import torch

from grpokit.math.advantages import _check_group_size


def groups_with_spread(rewards: torch.Tensor, valid: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """BoolTensor [N / group_size]: True where a group can teach.

    rewards: [N]; valid: [N] bool, False where the reward failed (its value, even NaN, is
    ignored), or None when every reward is valid. A group has a spread when at least 2 of its
    rewards are valid and they are not all equal -- exactly the groups that
    masked_outcome_advantages gives a non-zero advantage.
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else torch.as_tensor(valid)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}; they must match")
    valid = valid.to(torch.bool)
    _check_group_size(rewards.numel(), group_size, "rewards")
    if not torch.isfinite(rewards[valid]).all():
        bad = torch.nonzero(valid & ~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards at rows {bad} are NaN or infinite but marked valid")
    v = valid.view(-1, group_size)
    # Compare each valid reward with the group's first valid one (exact equality, as eq. 5's
    # all-equal rule); invalid slots hold 0 so NaN never reaches the comparison.
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size)
    first_valid = r.gather(1, v.to(torch.uint8).argmax(dim=1, keepdim=True))
    differs = (r != first_valid) & v
    return differs.any(dim=1) & (v.sum(dim=1) >= 2)
