"""Pure tensor math of GRPO and its PPO baseline (see SPEC.md): no models, no I/O."""

from grpokit.math.advantages import (
    gae_advantages,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
)
from grpokit.math.losses import grpo_loss, kl_k3, value_loss

__all__ = [
    "gae_advantages",
    "grpo_loss",
    "kl_k3",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "value_loss",
]
