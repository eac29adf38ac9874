"""Losses: the k3 KL estimator (eq. 4), GRPO's clipped objective (eq. 3) with its common
variants (token / constant aggregation, GSPO's sequence ratio, an importance-sampling correction)
as one run's GRPOObjective, PPO's value loss. Each policy term and importance correction is its own
function registered by name (math/registry.py): the clipped surrogate here, CISPO, TIS and icepop in
their own modules; GRPOObjective looks them up once.

All inputs are per-token log-probs of the *sampled* tokens, shape [N, T], with a mask
[N, T] that is 1 on completion tokens. Pure tensor code: no models, no I/O.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from grpokit.math.registry import LossSettings, PolicyTerm, check_args, register_policy_loss
from grpokit.math.registry import is_correction as registered_is_correction
from grpokit.math.registry import policy_loss as registered_policy_loss

AGGREGATIONS = ("sequence", "token", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")

# Below this |d| the series of exp(d) - d - 1 is exact to float64 precision, where the
# direct form would cancel to 0 and break "k3 = 0 iff logp = ref".
_K3_SERIES_BELOW = 1e-3


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative KL estimator (docs/algorithm.md, eq. 4), elementwise.

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


def loss_denominator(mask: torch.Tensor, aggregation: str) -> float:
    """The count `grpo_loss` divides by on this batch alone, for `aggregation`.

    mask: [N, T]. "sequence": the number of non-empty rows; "token": the number of masked
    tokens; "constant": N, every completion (L_max is applied by grpo_loss).
    Sum it over the micro-batches of one optimizer step and over all processes, and pass
    the total as grpo_loss(denominator=...): the summed losses, and so the gradients, then
    equal those of the whole batch in one piece.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(mask.shape)}")
    m = mask.to(torch.float64)
    if aggregation == "sequence":
        return float((m.sum(dim=1) > 0).sum().item())
    if aggregation == "token":
        return float(m.sum().item())
    return float(mask.shape[0])


def _check_options(aggregation: str, max_completion_length: int | None, importance_level: str) -> None:
    """The loss's options beyond the paper, checked once when a GRPOObjective is made; each message
    names the argument to fix."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if importance_level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_level must be one of {IMPORTANCE_LEVELS}, got {importance_level!r}")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, numbers.Integral)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be an int >= 1, got {max_completion_length!r}")
    if aggregation == "constant" and max_completion_length is None:
        raise ValueError(
            "aggregation='constant' divides by N * L_max and needs max_completion_length=L_max "
            "(the generation limit); pass it, or choose aggregation='sequence' or 'token'"
        )


def _check_tensors(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor | None,
    is_cap: float | None,
    denominator: float | torch.Tensor | None,
) -> None:
    """The arguments of one call that go with the options (sampling_logp and is_cap, denominator)."""
    if sampling_logp is None:
        if is_cap is not None:
            raise ValueError(
                f"is_cap={is_cap!r} caps the truncated importance weight, which needs sampling_logp "
                "(the sampling engine's log-probs); pass sampling_logp or drop is_cap"
            )
    elif sampling_logp.shape != logp.shape:
        raise ValueError(f"sampling_logp has shape {tuple(sampling_logp.shape)} but logp has {tuple(logp.shape)}")
    if is_cap is not None and not (isinstance(is_cap, numbers.Real) and is_cap > 0):
        raise ValueError(f"is_cap must be a number > 0 (the cap C of the importance weight), got {is_cap!r}")
    if denominator is not None:
        if isinstance(denominator, torch.Tensor):
            if denominator.dim() != 0:
                raise ValueError(f"denominator must be a scalar, got a tensor of shape {tuple(denominator.shape)}")
        elif isinstance(denominator, bool) or not isinstance(denominator, numbers.Real) or not denominator >= 0:
            raise ValueError(
                f"denominator must be a count >= 0 (loss_denominator summed over micro-batches and "
                f"processes), got {denominator!r}"
            )


def _divide(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """total / count, with a count of 0 (nothing to average: total is 0 too) read as 1."""
    if isinstance(count, torch.Tensor):
        count = count.to(total.dtype)
        return total / torch.where(count > 0, count, torch.ones_like(count))
    return total / (count if count > 0 else 1.0)


def aggregate(
    term: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    max_completion_length: int | None = None,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-token `term` [N, T] over the batch, as the objective to maximise: the one place
    every loss is aggregated (docs/algorithm.md, "Beyond the paper").

    "sequence": mean_i(sum_t m term / sum_t m), rows with an all-zero mask left out;
    "token":    sum m term / sum m;
    "constant": sum m term / (N * L_max), L_max = max_completion_length.
    denominator replaces the count (non-empty rows, masked tokens, N) with one counted over the
    whole optimizer step (loss_denominator summed over micro-batches and processes); 0 reads as 1.
    """
    m = mask.to(term.dtype)
    if aggregation == "sequence":
        lengths = m.sum(dim=1)
        rows = lengths > 0
        per_seq = (term * m).sum(dim=1) / lengths.clamp(min=1)
        return _divide((per_seq * rows).sum(), rows.sum() if denominator is None else denominator)
    if aggregation == "token":
        return _divide((term * m).sum(), m.sum() if denominator is None else denominator)
    if aggregation == "constant":
        n_completions = term.shape[0] if denominator is None else denominator
        return _divide((term * m).sum(), n_completions) / max_completion_length
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


@register_policy_loss("clip")
def clipped_surrogate(logp, old_logp, advantages, mask, settings: LossSettings) -> PolicyTerm:
    """PPO's clipped surrogate (eq. 3): min(rho A, clip(rho, 1 - eps, 1 + eps_high) A), with the
    per-token ratio, or GSPO's length-normalised sequence ratio (importance_level=sequence)."""
    m = mask.to(logp.dtype)
    if settings.importance_level == "sequence":
        # GSPO: the mean log-ratio over the output's tokens; padding never enters, and an
        # empty row gets log s = 0 / 1 = 0 instead of 0 / 0.
        log_ratio = torch.where(m > 0, logp - old_logp, torch.zeros_like(logp))
        seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
        ratio = torch.exp(seq_log_ratio).expand_as(logp)
    else:
        ratio = torch.exp(logp - old_logp)
    low, high = 1.0 - settings.clip_eps, 1.0 + settings.clip_eps_high
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    # The clip is active where min() chose the clipped term and it differs.
    return PolicyTerm(surrogate, ratio, (ratio < low) & (advantages < 0), (ratio > high) & (advantages > 0))


@dataclass(frozen=True)
class GRPOObjective:
    """GRPO's loss, -J_GRPO (docs/algorithm.md, eq. 3), and its common variants, for one run: the
    registered policy loss is looked up and its arguments checked once, when the objective is made
    (the importance-sampling correction on its first call with sampling_logp), not per micro-batch.

    Per token: term = w * policy_term - beta k3, then aggregated (`aggregate`) and negated.

    policy_loss: a registered policy loss (math/registry.py), its arguments in loss_args.
       "clip" (default) is eq. 3's min(rho A, clip(rho, 1-eps, 1+eps_high) A), where
       importance_level "token":    rho_{i,t} = exp(logp - old_logp), the paper's per-token ratio.
                        "sequence": rho_{i,t} = s_i = exp(sum_t m (logp - old_logp) / sum_t m), one
                                    length-normalised ratio per output (GSPO, Zheng et al. 2025,
                                    arXiv:2507.18071); the gradient flows through s_i, the KL stays
                                    per token. A row with an empty mask gets s_i = 1.
       "cispo" (math/cispo.py): sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp (MiniMax-M1).
    w: 1, or with sampling_logp (the sampling engine's log-probs of the same tokens) the weight
       the registered correction `is_correction` makes of the detached ratio pi_old / pi_sampler:
       "tis" (math/tis.py; the default when sampling_logp is given): min(exp(old_logp - sampling_logp), C),
       C = is_args cap (default 2.0); "icepop" (math/icepop.py): the ratio where it lies in [low, high],
       else 0 (the token's policy term dropped, the token still counted). is_cap=C is the older
       spelling of is_args={"cap": C} for tis.
    aggregation "sequence" (the paper's 1/|o_i| then 1/G), "token" (DAPO, arXiv:2503.14476) or
       "constant" (Dr. GRPO, arXiv:2503.20783: / (N * L_max), L_max = max_completion_length,
       required here and unused otherwise); rows with an all-zero mask count for nothing.
    """

    clip_eps: float = 0.2
    beta: float = 0.04
    clip_eps_high: float | None = None
    aggregation: str = "sequence"
    max_completion_length: int | None = None
    importance_level: str = "token"
    is_cap: float | None = None
    policy_loss: str = "clip"
    loss_args: Mapping | None = None
    is_correction: str | None = None
    is_args: Mapping | None = None

    def __post_init__(self) -> None:
        _check_options(self.aggregation, self.max_completion_length, self.importance_level)
        entry = registered_policy_loss(self.policy_loss)
        check_args(entry, self.loss_args or {}, "loss_args")
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        object.__setattr__(self, "_policy", entry.function)
        object.__setattr__(self, "_settings", LossSettings(self.clip_eps, high, self.importance_level,
                                                           dict(self.loss_args or {})))
        object.__setattr__(self, "_correction", None)  # (function, args), on the first call that needs it

    def correction(self):
        """(function, args) of the importance-sampling correction, looked up and checked once."""
        if self._correction is None:
            name = self.is_correction or "tis"
            if self.is_cap is not None and name != "tis":  # is_cap: tis's cap, from before is_args
                raise ValueError(f"is_cap is the cap of the tis correction; {name!r} takes its arguments in is_args")
            entry = registered_is_correction(name)
            args = {**({"cap": float(self.is_cap)} if self.is_cap is not None else {}), **(self.is_args or {})}
            check_args(entry, args, "is_args")
            object.__setattr__(self, "_correction", (entry.function, args))
        return self._correction

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        sampling_logp: torch.Tensor | None = None,
        denominator: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, stats) of one batch. logp, old_logp, ref_logp, mask, sampling_logp: [N, T];
        advantages: [N] (outcome) or [N, T] (process); ref_logp may be None only when beta == 0.
        denominator: replaces the count divided by with one counted over the whole optimizer step
        (see `aggregate`), so the pieces of a step add up to the loss of the whole batch.
        stats are detached scalars over this batch's masked tokens: kl, clip_fraction(_low/_high),
        ratio_mean (of the ratio used), policy_loss (-mean of w * policy term), tokens; with
        sampling_logp also logp_mismatch (mean |old_logp - sampling_logp|) and the correction's own
        (tis: is_weight_mean, is_capped_frac; icepop: is_weight_mean, is_dropped_frac)."""
        _check_tensors(logp, sampling_logp, self.is_cap, denominator)
        advantages = _checked_advantages(logp, old_logp, ref_logp, advantages, mask, self.beta)
        m = mask.to(logp.dtype)
        advantages = advantages.to(logp.dtype)
        policy = self._policy(logp, old_logp, advantages, mask, self._settings)
        correction_stats: dict[str, torch.Tensor] = {}
        if sampling_logp is not None:
            function, args = self.correction()
            with torch.no_grad():  # a correction of the sampling distribution, not a thing to optimise
                weight, correction_stats = function(torch.exp(old_logp - sampling_logp), mask, args)
            policy_term = weight * policy.term
        else:
            policy_term = policy.term
        kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
        loss = -aggregate(policy_term - self.beta * kl, mask, self.aggregation, self.max_completion_length,
                          denominator)
        with torch.no_grad():
            stats = _loss_stats(policy, policy_term, kl, m)
            if sampling_logp is not None:
                mismatch = torch.where(m > 0, (old_logp - sampling_logp).abs(), torch.zeros_like(m))
                stats["logp_mismatch"] = _masked_mean(mismatch, m)
                stats.update(correction_stats)
        return loss, stats


def _checked_advantages(logp, old_logp, ref_logp, advantages, mask, beta: float) -> torch.Tensor:
    """The advantages as [N, 1] or [N, T], after the tensors' shapes are checked against logp's."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask)) + ((("ref_logp", ref_logp),) if ref_logp is not None else ()):
        if t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp has {tuple(logp.shape)}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"ref_logp is None but beta={beta}; pass reference log-probs or set beta=0")
    if advantages.shape == logp.shape[:1]:
        return advantages.unsqueeze(1)
    if advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [N]={tuple(logp.shape[:1])} or [N, T]={tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    return advantages


def _loss_stats(policy: PolicyTerm, policy_term: torch.Tensor, kl: torch.Tensor, m: torch.Tensor) -> dict:
    low, high = policy.clipped_low, policy.clipped_high
    return {
        "kl": _masked_mean(kl, m),
        "clip_fraction": _masked_mean((low | high).to(m.dtype), m),
        "clip_fraction_low": _masked_mean(low.to(m.dtype), m),
        "clip_fraction_high": _masked_mean(high.to(m.dtype), m),
        "ratio_mean": _masked_mean(policy.ratio, m),
        "policy_loss": -_masked_mean(policy_term, m),
        "tokens": m.sum(),
    }


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
    *,
    max_completion_length: int | None = None,
    importance_level: str = "token",
    sampling_logp: torch.Tensor | None = None,
    is_cap: float | None = None,
    denominator: float | torch.Tensor | None = None,
    policy_loss: str = "clip",
    loss_args: Mapping | None = None,
    is_correction: str | None = None,
    is_args: Mapping | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's loss, -J_GRPO (docs/algorithm.md, eq. 3), on one batch: GRPOObjective(options)(tensors),
    which says what each option means. A training loop makes the GRPOObjective once and calls it on
    every micro-batch; this one call makes it anew. Returns (loss, stats)."""
    objective = GRPOObjective(clip_eps, beta, clip_eps_high, aggregation, max_completion_length, importance_level,
                              is_cap, policy_loss, loss_args, is_correction, is_args)
    return objective(logp, old_logp, ref_logp, advantages, mask, sampling_logp, denominator)


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
    """Outcome reward model loss (docs/algorithm.md, reward sources): mean of -log sigma(r(q, chosen) - r(q, rejected)).

    chosen, rejected: [N] scalar rewards of the two completions of each pair. logsigmoid keeps
    it finite for large margins, where log(sigmoid(x)) would round to log(0).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be [N]")
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def step_bce_loss(step_logits: torch.Tensor, labels: torch.Tensor, balance: bool = False) -> torch.Tensor:
    """Process reward model loss: binary cross-entropy of each step's logit (read at the step's
    last token) against its 0/1 correctness label, averaged over all steps of the batch. [S], [S].

    balance: the mean of the right steps' mean and the wrong steps' mean instead, so the rarer
    class weighs as much as the common one (a batch holding one class only: the plain mean).
    """
    if step_logits.shape != labels.shape or step_logits.dim() != 1:
        raise ValueError(f"step_logits {tuple(step_logits.shape)} and labels {tuple(labels.shape)} must both be [S]")
    per_step = torch.nn.functional.binary_cross_entropy_with_logits(step_logits, labels.to(step_logits.dtype),
                                                                    reduction="none")
    right = labels.bool()
    if balance and 0 < int(right.sum()) < right.numel():
        return 0.5 * (per_step[right].mean() + per_step[~right].mean())
    return per_step.mean()
