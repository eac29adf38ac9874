"""grpokit: Group Relative Policy Optimization (DeepSeekMath) for causal language models.

The math is importable from here without loading transformers:

    from grpokit import outcome_advantages, process_advantages, kl_k3, grpo_loss, gae_advantages
"""

from grpokit.math import (
    gae_advantages,
    grpo_loss,
    kl_k3,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
    value_loss,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "gae_advantages",
    "grpo_loss",
    "kl_k3",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "value_loss",
]
