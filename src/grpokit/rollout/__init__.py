"""Turning prompts into groups of completions with their per-token log-probs.

Every module of this package is imported with it, so an engine module's registration
(rollout/registry.py) is all a new engine takes; optional engine packages (vllm) are imported
only when such an engine is built."""

import importlib as _importlib
import pkgutil as _pkgutil

from grpokit.rollout.engine import (HFEngine, RolloutEngine, longest_prompt_tokens, make_engine, max_model_len,
                                   request_seeds, run_max_model_len, RolloutEngineError,
                                   WeightSyncError)
from grpokit.errors import renamed_names
from grpokit.models import logprobs as _logprobs
from grpokit.rollout.multi_turn import ToolEngine, ToolRollout, multi_turn_rollout
from grpokit.rollout.registry import ENGINES, engine_spec, register_engine
from grpokit.rollout.sampler import Continuation, SamplingParams, sample_groups

for _module in _pkgutil.iter_modules(__path__):  # engine registrations, one module each
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Continuation", "ENGINES", "engine_spec", "register_engine", "HFEngine", "RolloutEngine", "SamplingParams", "longest_prompt_tokens", "make_engine", "max_model_len",
           "request_seeds", "run_max_model_len", "sample_groups",
           "ToolEngine", "ToolRollout", "multi_turn_rollout", "RolloutEngineError", "WeightSyncError"]

# Moved in 0.3: the log-prob passes live in grpokit.models.logprobs (rollout, rewards and training all
# score tokens with them); their old names here still work for one release, with a warning.
__getattr__ = renamed_names(__name__, {name: (getattr(_logprobs, name), f"grpokit.models.logprobs.{name}")
                                       for name in ("token_logprobs", "position_ids_for")})
