"""Pure tensor math of GRPO and its PPO baseline (see SPEC.md): no models, no I/O."""

from grpokit.math.advantages import (
    gae_advantages,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
)
from grpokit.math.losses import (
    bradley_terry_loss,
    grpo_loss,
    kl_k3,
    step_bce_loss,
    value_loss,
)

__all__ = [
    "bradley_terry_loss",
    "gae_advantages",
    "grpo_loss",
    "kl_k3",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "step_bce_loss",
    "value_loss",
]
