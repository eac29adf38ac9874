"""Truncated importance sampling (TIS): where the sampling engine and the trainer disagree on a
token, weight its policy term by their ratio, capped (docs/algorithm.md, "Truncated importance
sampling").

    w_t = exp(old_logp_t - sampling_logp_t)   (detached)
    weight_t = min(w_t, cap)

The KL term is not reweighted. Arguments (rollout.is_args): cap (default 2.0); rollout.is_cap is
the older key for the same cap. grpo_loss uses this correction when given sampling_logp and no
other.
"""

from __future__ import annotations

import numbers

import torch

from grpokit.math.registry import only_keys, register_is_correction

DEFAULT_IS_CAP = 2.0


def _cap(args) -> float:
    cap = only_keys(args, {"cap": DEFAULT_IS_CAP}, "tis")["cap"]
    if not (isinstance(cap, numbers.Real) and not isinstance(cap, bool) and cap > 0):
        raise ValueError(f"tis: cap must be a number > 0 (the cap C of the weight), got {cap!r}")
    return float(cap)


def check(args) -> None:
    _cap(args)


@register_is_correction("tis", check=check)
def truncated_importance_weight(raw_weight: torch.Tensor, mask: torch.Tensor, args):
    """tis: w_t = min(pi_old / pi_sampler, C), C = `cap` (default 2)."""
    cap = _cap(args)
    m = mask.to(raw_weight.dtype)
    weight = torch.where(m > 0, raw_weight.clamp(max=cap), torch.ones_like(raw_weight))
    tokens = m.sum().clamp(min=1)
    return weight, {"is_weight_mean": (weight * m).sum() / tokens,
                    "is_capped_frac": ((raw_weight > cap).to(m.dtype) * m).sum() / tokens}
