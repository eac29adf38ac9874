"""Advantage estimators: GRPO outcome (eq. 5), GRPO process (eq. 6) and PPO's GAE.

Shapes: N = prompts x G completions, groups contiguous (rows p*G .. p*G+G-1 belong
to prompt p); T = completion tokens. Pure tensor code: no models, no I/O.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpokit.math.registry import register_advantage, register_process_advantage

DEFAULT_EPS = 1e-4


def _check_group_size(n: int, group_size: int, what: str) -> int:
    try:
        size = operator.index(group_size)  # accepts numpy ints, rejects 2.0
    except TypeError:
        size = None
    if size is None or size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (GRPO compares samples within a group), got {group_size!r}"
        )
    if n % group_size != 0:
        raise ValueError(
            f"{what} has {n} rows, which is not divisible by group_size={group_size}; "
            f"pass complete groups of {group_size} contiguous samples per prompt"
        )
    return size


def masked_outcome_advantages(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    group_size: int,
    scale: bool = True,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Outcome advantages (eq. 5) over the valid samples of each group.

    rewards: [N]; valid: [N] bool, False where the reward failed (its value is ignored).
    Group statistics use only valid samples; invalid samples get advantage 0, and so
    does every sample of a group with fewer than 2 valid members or all-equal rewards.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}; they must match")
    group_size = _check_group_size(rewards.shape[0], group_size, "rewards")
    valid = valid.to(torch.bool)
    if not torch.isfinite(rewards[valid]).all():
        bad = torch.nonzero(valid & ~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards at rows {bad} are NaN or infinite but marked valid")

    r = torch.where(valid, rewards, torch.zeros_like(rewards)).view(-1, group_size)
    v = valid.view(-1, group_size)
    vf = v.to(r.dtype)
    n_valid = vf.sum(dim=1, keepdim=True)
    mean = r.sum(dim=1, keepdim=True) / n_valid.clamp(min=1)
    centred = (r - mean) * vf
    adv = centred
    if scale:
        var = centred.pow(2).sum(dim=1, keepdim=True) / (n_valid - 1).clamp(min=1)
        adv = centred / (var.sqrt() + eps)
    # A group whose valid rewards are all equal teaches nothing: exactly 0, no rounding residue.
    first_valid = r.gather(1, v.to(torch.uint8).argmax(dim=1, keepdim=True))
    all_equal = ((r == first_valid) | ~v).all(dim=1, keepdim=True) | (n_valid < 2)
    adv = torch.where(all_equal | ~v, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


@register_advantage("grpo")
def group_normalised(rewards: torch.Tensor, valid: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """Eq. 5: (r - mean(group)) / std(group); with scale=False (grpo.scale_rewards) r - mean (Dr. GRPO)."""
    return masked_outcome_advantages(rewards, valid, group_size, scale=scale)


def outcome_advantages(
    rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """GRPO outcome supervision (docs/algorithm.md, eq. 5): A_i = (r_i - mean(r)) / (std(r) + eps).

    rewards: [N], groups of `group_size` contiguous. std is the unbiased sample std.
    scale=False gives r_i - mean(r) (Dr. GRPO). An all-equal group gives exactly 0.
    Returns [N], the advantage shared by every token of completion i.
    """
    rewards = torch.as_tensor(rewards)
    if not torch.is_floating_point(rewards):
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(
            f"rewards at rows {bad} are NaN or infinite; mask failed samples with masked_outcome_advantages"
        )
    return masked_outcome_advantages(
        rewards, torch.ones_like(rewards, dtype=torch.bool), group_size, scale=scale, eps=eps
    )


@dataclass
class StepRewards:
    """Checked step rewards of N completions: rewards[i] [K_i] float64, ends[i] [K_i] long (0-based index
    of each step's last token), lengths[i] the completion's token count, and the output dtype."""

    rewards: list[torch.Tensor]
    ends: list[torch.Tensor]
    lengths: list[int]
    group_size: int
    dtype: torch.dtype

    def empty(self) -> torch.Tensor:
        """[N, T_max] float64 zeros."""
        return torch.zeros(len(self.rewards), max(self.lengths, default=0), dtype=torch.float64)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """`out` [N, T_max] with every position at or past a completion's length zeroed, in the output dtype."""
        positions = torch.arange(out.shape[1]).unsqueeze(0)
        return (out * (positions < torch.tensor(self.lengths).unsqueeze(1))).to(self.dtype)


def check_step_rewards(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    num_tokens: Sequence[int],
    group_size: int,
) -> StepRewards:
    """The inputs of eq. 6 and its variants, checked and in float64 (see process_advantages)."""
    n = len(step_rewards)
    if len(step_ends) != n or len(num_tokens) != n:
        raise ValueError(
            f"step_rewards, step_ends and num_tokens must have one entry per completion; "
            f"got {n}, {len(step_ends)} and {len(num_tokens)}"
        )
    group_size = _check_group_size(n, group_size, "step_rewards")
    dtype = next(
        (r.dtype for r in step_rewards if isinstance(r, torch.Tensor) and torch.is_floating_point(r)),
        torch.get_default_dtype(),
    )
    lengths = [int(x) for x in (num_tokens.tolist() if isinstance(num_tokens, torch.Tensor) else num_tokens)]
    # Normalise in float64 whatever the output dtype: cheap here, and exact to the spec.
    rewards = [torch.as_tensor(r).to(torch.float64).reshape(-1) for r in step_rewards]
    ends = [torch.as_tensor(e, dtype=torch.long).reshape(-1) for e in step_ends]
    for i, (r, e, length) in enumerate(zip(rewards, ends, lengths)):
        if r.numel() != e.numel():
            raise ValueError(f"completion {i}: {r.numel()} step rewards but {e.numel()} step ends")
        if e.numel() and (e.min() < 0 or e.max() >= length):
            raise ValueError(f"completion {i}: step ends {e.tolist()} must lie in [0, num_tokens={length})")
        if not torch.isfinite(r).all():
            raise ValueError(f"completion {i}: step rewards {r.tolist()} contain NaN or infinity")
    return StepRewards(rewards, ends, lengths, group_size, dtype)


def normalised_step_rewards(steps: StepRewards, eps: float = DEFAULT_EPS) -> list[torch.Tensor]:
    """r~ of eq. 6: each step reward minus the mean of all steps of its group, over their unbiased std + eps.
    A group whose steps are all equal (or that has none) gets exact zeros: nothing to prefer."""
    out = [torch.zeros_like(r) for r in steps.rewards]
    g = steps.group_size
    for start in range(0, len(steps.rewards), g):
        flat = torch.cat(steps.rewards[start : start + g])
        if flat.numel() == 0 or bool((flat == flat[0]).all()):
            continue
        mean, std = flat.mean(), flat.std()  # unbiased, as in eq. 5
        for i in range(start, start + g):
            out[i] = (steps.rewards[i] - mean) / (std + eps)
    return out


def summed_after(steps: StepRewards, per_step: list[torch.Tensor]) -> torch.Tensor:
    """[N, T_max]: token t of completion i gets the sum of per_step[i][j] over the steps j ending at or
    after t (eq. 6's sum), before the length mask."""
    out = steps.empty()
    for i, (values, ends) in enumerate(zip(per_step, steps.ends)):
        out[i].index_add_(0, ends, values)  # a step's value sits at its last token
    # A token is credited with every step ending at or after it: a reverse cumulative sum.
    return out.flip(-1).cumsum(-1).flip(-1)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    num_tokens: Sequence[int],
    group_size: int,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """GRPO process supervision (docs/algorithm.md, eq. 6).

    step_rewards[i][j]: reward of step j of completion i; step_ends[i][j]: 0-based index of
    that step's last token; num_tokens[i]: completion length. Step rewards are normalised
    over all steps of the group (unbiased std + eps); token t of completion i gets
    sum_{j: end_j >= t} r~_i^j. Returns [N, T_max], zero at positions >= num_tokens[i].
    """
    steps = check_step_rewards(step_rewards, step_ends, num_tokens, group_size)
    return steps.finish(summed_after(steps, normalised_step_rewards(steps, eps)))


@register_process_advantage("grpo")
def summed_process_advantages(step_rewards, step_ends, num_tokens, group_size) -> torch.Tensor:
    """Eq. 6: the group-normalised rewards of the steps ending at or after each token, summed."""
    return process_advantages(step_rewards, step_ends, num_tokens, group_size)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for the PPO baseline (docs/algorithm.md, eq. 1-2).

    rewards, values, mask: [N, T]. Over each row's valid tokens (in order, skipping masked
    positions): delta_t = r_t + gamma V_{t+1} - V_t with V = 0 past the last valid token,
    A_t = sum_l (gamma lam)^l delta_{t+l}. Returns (advantages, returns = A + V), both
    zero outside the mask.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must share one [N, T] shape; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    m = mask.to(torch.bool)
    zero = torch.zeros_like(values[:, 0])
    next_value, running = zero, zero
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        valid = m[:, t]
        advantages.append(torch.where(valid, gae, zero))
        running = torch.where(valid, gae, running)
        next_value = torch.where(valid, values[:, t], next_value)
    adv = torch.stack(advantages[::-1], dim=1)
    returns = torch.where(m, adv + values, torch.zeros_like(values))
    return adv, returns
