"""grpokit: Group Relative Policy Optimization (DeepSeekMath) for causal language models.

The math is importable from here without loading transformers:

    from grpokit import outcome_advantages, process_advantages, kl_k3, grpo_loss, gae_advantages

and training from Python is one call, the same run as `grpokit train` (grpokit/front_door/__init__.py; it loads
the training stack when called, not on `import grpokit`):

    run = grpokit.train("tiny", rewards=["chain_accuracy"], config={"grpo.max_steps": 2})
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
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
    # 0.3: the log-prob passes sit below rollout and rewards, which both score tokens with them
    "grpokit.rollout.logprobs": "grpokit.models.logprobs",
    "grpokit.pipeline.api": "grpokit.front_door",
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


class _TrainPackage(types.ModuleType):
    """`grpokit.train` is the package of training loops, and calling it is the front door: a
    submodule import sets the parent's attribute to the package, so a function of that name would
    be replaced by it; the package itself is made callable instead."""

    def __call__(self, *args, **kwargs):
        from grpokit.front_door import train  # the training stack loads here, not on `import grpokit`

        return train(*args, **kwargs)


# light: the package's __init__ is its docstring; none of its modules load here
importlib.import_module("grpokit.train").__class__ = _TrainPackage


def __getattr__(name: str):
    """grpokit.Run, the result of grpokit.train, loaded on first use like the front door."""
    if name == "Run":
        from grpokit.front_door import Run

        return Run
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")

__all__ = [
    "Run",
    "__version__",
    "gae_advantages",
    "grpo_loss",
    "kl_k3",
    "masked_outcome_advantages",
    "outcome_advantages",
    "process_advantages",
    "train",
    "value_loss",
]
