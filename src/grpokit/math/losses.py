"""Losses: the k3 KL estimator (eq. 4), GRPO's clipped objective (eq. 3), PPO's value loss.

All inputs are per-token log-probs of the *sampled* tokens, shape [N, T], with a mask
[N, T] that is 1 on completion tokens. Pure tensor code: no models, no I/O.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("sequence", "token")

# Below this |d| the series of exp(d) - d - 1 is exact to float64 precision, where the
# direct form would cancel to 0 and break "k3 = 0 iff logp = ref".
_K3_SERIES_BELOW = 1e-3


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative KL estimator (SPEC eq. 4), elementwise.

    With d = ref_logp - logp: k3 = exp(d) - d - 1 >= 0, zero iff logp == ref_logp.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp has shape {tuple(logp.shape)} but ref_logp {tuple(ref_logp.shape)}")
    d = ref_logp - logp
    small = d.abs() < _K3_SERIES_BELOW
    ds = torch.where(small, d, torch.zeros_like(d))  # keeps the unused branch finite for autograd
    series = ds * ds * (0.5 + ds * (1.0 / 6 + ds * (1.0 / 24 + ds / 120)))
    dl = torch.where(small, torch.ones_like(d), d)
    direct = torch.expm1(dl) - dl
    return torch.where(small, series, direct).clamp_min(0.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    clip_eps_high: float | None = None,
    aggregation: str = "sequence",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss, -J_GRPO (SPEC eq. 3).

    logp, old_logp, ref_logp, mask: [N, T]; advantages: [N] (outcome) or [N, T] (process).
    Per token: term = min(rho A, clip(rho, 1-eps, 1+eps_high) A) - beta k3, rho = exp(logp - old_logp).
    aggregation "sequence": -mean_i(sum_t m term / sum_t m), the paper's 1/|o_i| then 1/G;
                "token":    -sum m term / sum m (DAPO).
    Rows with an all-zero mask (e.g. a failed reward) are left out of the sequence mean.
    ref_logp may be None only when beta == 0.
    Returns (loss, stats); stats are detached scalars: kl, clip_fraction, ratio_mean, ...
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask)) + ((("ref_logp", ref_logp),) if ref_logp is not None else ()):
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp has {tuple(logp.shape)}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"ref_logp is None but beta={beta}; pass reference log-probs or set beta=0")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [N]={tuple(logp.shape[:1])} or [N, T]={tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.to(logp.dtype)
    advantages = advantages.to(logp.dtype)

    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    term = surrogate - beta * kl

    if aggregation == "sequence":
        lengths = m.sum(dim=1)
        rows = lengths > 0
        per_seq = (term * m).sum(dim=1) / lengths.clamp(min=1)
        loss = -(per_seq * rows).sum() / rows.sum().clamp(min=1)
    else:
        loss = -_masked_mean(term, m)

    with torch.no_grad():
        # The clip is active where min() chose the clipped term and it differs.
        low = (ratio < 1.0 - eps_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_high) & (advantages > 0)
        stats = {
            "kl": _masked_mean(kl, m),
            "clip_fraction": _masked_mean((low | high).to(m.dtype), m),
            "clip_fraction_low": _masked_mean(low.to(m.dtype), m),
            "clip_fraction_high": _masked_mean(high.to(m.dtype), m),
            "ratio_mean": _masked_mean(ratio, m),
            "policy_loss": -_masked_mean(surrogate, m),
            "tokens": m.sum(),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
) -> torch.Tensor:
    """PPO critic loss: 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), masked token mean.

    values, old_values, returns, mask: [N, T]. clip_range=None gives the plain squared error.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must share one shape"
        )
    m = mask.to(values.dtype)
    err = (values - returns).pow(2)
    if clip_range is not None:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (clipped - returns).pow(2))
    return 0.5 * _masked_mean(err, m)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Outcome reward model loss (SPEC, reward sources): mean of -log sigma(r(q, chosen) - r(q, rejected)).

    chosen, rejected: [N] scalar rewards of the two completions of each pair. logsigmoid keeps
    it finite for large margins, where log(sigmoid(x)) would round to log(0).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be [N]")
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def step_bce_loss(step_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Process reward model loss: binary cross-entropy of each step's logit (read at the step's
    last token) against its 0/1 correctness label, averaged over all steps of the batch. [S], [S]."""
    if step_logits.shape != labels.shape or step_logits.dim() != 1:
        raise ValueError(f"step_logits {tuple(step_logits.shape)} and labels {tuple(labels.shape)} must both be [S]")
    return torch.nn.functional.binary_cross_entropy_with_logits(step_logits, labels.to(step_logits.dtype))
