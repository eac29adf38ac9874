"""grpokit: Group Relative Policy Optimization (DeepSeekMath) for causal language models.

The math is importable from here without loading transformers:

    from grpokit import outcome_advantages, process_advantages, kl_k3, grpo_loss, gae_advantages
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

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

# Modules that moved in 0.2 (docs/changelog.md): their old paths, which users' own reward and task
# files may import, still work for one release, with a warning naming the new path.
MOVED_MODULES = {
    "grpokit.build": "grpokit.pipeline.build",
    "grpokit.checkpoint": "grpokit.run.checkpoint",
    "grpokit.loggers": "grpokit.run.loggers",
    "grpokit.metrics": "grpokit.run.metrics",
    "grpokit.progress": "grpokit.run.progress",
    "grpokit.report": "grpokit.pipeline.report",
    "grpokit.resume": "grpokit.pipeline.resume",
    "grpokit.rollout_worker": "grpokit.pipeline.rollout_worker",
    "grpokit.rewards.answers": "grpokit.data.answers",
    "grpokit.rundir": "grpokit.run.directory",
    "grpokit.runlock": "grpokit.run.lock",
    "grpokit.sandbox": "grpokit.tools.sandbox",
    "grpokit.signals": "grpokit.run.signals",
    "grpokit.stages": "grpokit.pipeline.stages",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module at its new one (the same module object), with a warning."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} is deprecated: import {new} instead (the old path goes in the next release)",
                      FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        """The module at the new path is already executed."""


sys.meta_path.append(_MovedModule())

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
