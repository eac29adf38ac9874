"""A policy loss of your own, registered by name and used as `grpo.loss: custom_loss:clipped_ratio_only`
(this folder on PYTHONPATH):

    PYTHONPATH=examples grpokit train --grpo.loss=custom_loss:clipped_ratio_only --grpo.loss_args='{eps: 0.1}'

The function gets the per-token log-probs [N, T] under the policy being trained (logp), at
sampling time (old_logp), the advantages ([N, 1] or [N, T]), the completion mask and the
settings (clip range, importance level, grpo.loss_args). It returns the per-token term to
maximise; grpokit multiplies it by any importance correction, subtracts beta * k3 and
aggregates it as grpo.loss_aggregation says (docs/algorithm.md).
"""

import torch

from grpokit.math import LossSettings, PolicyTerm, register_policy_loss


def check(args) -> None:
    """Runs when the config loads: a bad argument stops the run before any model loads."""
    unknown = set(args) - {"eps"}
    if unknown:
        raise ValueError(f"clipped_ratio_only takes eps; got {', '.join(sorted(unknown))}")
    if not 0 < args.get("eps", 0.2) < 1:
        raise ValueError(f"clipped_ratio_only: eps must lie in (0, 1), got {args['eps']}")


@register_policy_loss("clipped_ratio_only", check=check)
def clipped_ratio_only(logp, old_logp, advantages, mask, settings: LossSettings) -> PolicyTerm:
    """The clipped ratio times A, always (no min with the unclipped term): a deliberately simple example."""
    eps = settings.args.get("eps", 0.2)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - eps, 1 + eps)
    return PolicyTerm(clipped * advantages, ratio, ratio < 1 - eps, ratio > 1 + eps)
