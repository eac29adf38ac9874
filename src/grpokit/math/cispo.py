"""CISPO (MiniMax-M1, arXiv:2506.13585): clip a detached importance weight instead of the
surrogate, so every token keeps its gradient (docs/algorithm.md, "CISPO").

    term_t = sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t,   rho_t = exp(logp_t - old_logp_t)

Its gradient with respect to logp_t is the clipped weight times A_t: tokens whose ratio left the
trust region still learn, at a bounded rate, where the clipped surrogate gives them none.

Arguments (grpo.loss_args): eps_high (default 0.28, DAPO's clip-higher value; MiniMax-M1 tunes
only this bound) and eps_low (default 1.0: 1 - eps_low = 0, no lower bound, as MiniMax-M1 runs it).
"""

from __future__ import annotations

import numbers

import torch

from grpokit.math.registry import LossSettings, PolicyTerm, only_keys, register_policy_loss

DEFAULTS = {"eps_low": 1.0, "eps_high": 0.28}


def _bounds(args) -> tuple[float, float]:
    values = only_keys(args, DEFAULTS, "cispo")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ValueError(f"cispo: {key} must be a number >= 0, got {value!r}")
    return 1.0 - float(values["eps_low"]), 1.0 + float(values["eps_high"])


def check(args) -> None:
    _bounds(args)


def cispo_term(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               eps_low: float = DEFAULTS["eps_low"], eps_high: float = DEFAULTS["eps_high"]) -> torch.Tensor:
    """sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp per token ([N, T]; A may be [N, 1])."""
    weight = torch.exp(logp - old_logp).detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    return weight * advantages * logp


@register_policy_loss("cispo", check=check)
def cispo(logp, old_logp, advantages, mask, settings: LossSettings) -> PolicyTerm:
    """CISPO: the clipped, detached importance weight times A times logp; every token keeps a gradient."""
    if settings.importance_level != "token":
        raise ValueError("cispo clips a per-token weight; set grpo.importance_sampling_level=token")
    low, high = _bounds(settings.args)
    ratio = torch.exp(logp - old_logp).detach()
    term = cispo_term(logp, old_logp, advantages, 1.0 - low, high - 1.0)
    return PolicyTerm(term, ratio, ratio < low, ratio > high)
