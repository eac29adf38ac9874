"""Pure tensor math of GRPO and its PPO baseline: no models, no I/O."""

from grpokit.math.advantages import (
    gae_advantages,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
)
from grpokit.math.losses import (
    AGGREGATIONS,
    DEFAULT_IS_CAP,
    IMPORTANCE_LEVELS,
    bradley_terry_loss,
    grpo_loss,
    kl_k3,
    loss_denominator,
    step_bce_loss,
    value_loss,
)
from grpokit.math.sampling import groups_with_spread

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_IS_CAP",
    "IMPORTANCE_LEVELS",
    "bradley_terry_loss",
    "gae_advantages",
    "groups_with_spread",
    "grpo_loss",
    "kl_k3",
    "loss_denominator",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "step_bce_loss",
    "value_loss",
]
