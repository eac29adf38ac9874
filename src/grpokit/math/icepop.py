"""Masked importance sampling (icepop): where the sampling engine and the trainer disagree too
much on a token, drop that token's policy term instead of capping its weight as TIS does
(docs/algorithm.md, "Masked importance sampling").

    w_t = exp(old_logp_t - sampling_logp_t)   (detached)
    weight_t = w_t  if low <= w_t <= high,  else 0

The dropped tokens keep their KL term and stay in the aggregation's count, so dropping a token
never makes the others weigh more. Arguments (rollout.is_args): low (default 0.5), high (default 2.0).
"""

from __future__ import annotations

import numbers

import torch

from grpokit.math.registry import only_keys, register_is_correction

DEFAULTS = {"low": 0.5, "high": 2.0}


def _bounds(args) -> tuple[float, float]:
    values = only_keys(args, DEFAULTS, "icepop")
    low, high = values["low"], values["high"]
    for key, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ValueError(f"icepop: {key} must be a number >= 0, got {value!r}")
    if not low <= 1.0 <= high:
        raise ValueError(f"icepop: low={low} <= 1 <= high={high} must hold (w = 1 is the engine agreeing)")
    return float(low), float(high)


def check(args) -> None:
    _bounds(args)


@register_is_correction("icepop", check=check)
def masked_importance_weight(raw_weight: torch.Tensor, mask: torch.Tensor, args):
    """icepop: the ratio pi_old / pi_sampler where it lies in [low, high], else 0 (the token dropped)."""
    low, high = _bounds(args)
    m = mask.to(raw_weight.dtype)
    kept = (raw_weight >= low) & (raw_weight <= high)
    weight = torch.where(m > 0, torch.where(kept, raw_weight, torch.zeros_like(raw_weight)), torch.ones_like(m))
    tokens = m.sum().clamp(min=1)
    return weight, {"is_weight_mean": (weight * m).sum() / tokens,
                    "is_dropped_frac": ((~kept).to(m.dtype) * m).sum() / tokens}
