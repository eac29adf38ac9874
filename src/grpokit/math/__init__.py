"""Pure tensor math of GRPO and its PPO baseline: no models, no I/O.

Every module of this package is imported with it, so a module that registers a policy loss or
an importance-sampling correction (math/registry.py) is all a new one takes."""

import importlib as _importlib
import pkgutil as _pkgutil

from grpokit.math.advantages import (
    gae_advantages,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
)
from grpokit.math.losses import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    GRPOObjective,
    aggregate,
    bradley_terry_loss,
    grpo_loss,
    kl_k3,
    loss_denominator,
    step_bce_loss,
    value_loss,
)
from grpokit.math.registry import (
    ADVANTAGES,
    IS_CORRECTIONS,
    POLICY_LOSSES,
    PROCESS_ADVANTAGES,
    LossSettings,
    PolicyTerm,
    register_advantage,
    register_is_correction,
    register_policy_loss,
    register_process_advantage,
)
from grpokit.math.sampling import groups_with_spread
from grpokit.math.tis import DEFAULT_IS_CAP

for _module in _pkgutil.iter_modules(__path__):  # registrations: losses, corrections (one file each)
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "DEFAULT_IS_CAP",
    "GRPOObjective",
    "IMPORTANCE_LEVELS",
    "IS_CORRECTIONS",
    "POLICY_LOSSES",
    "PROCESS_ADVANTAGES",
    "LossSettings",
    "PolicyTerm",
    "aggregate",
    "bradley_terry_loss",
    "gae_advantages",
    "groups_with_spread",
    "grpo_loss",
    "kl_k3",
    "loss_denominator",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "register_advantage",
    "register_is_correction",
    "register_policy_loss",
    "register_process_advantage",
    "step_bce_loss",
    "value_loss",
]
