"""Reward functions by name: built-ins, or any `package.module:function` a config names."""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFunction = Callable[..., list]

_REGISTRY: dict[str, RewardFunction] = {}


def register_reward(name: str):
    """Decorator: make `fn` available to configs as `name`."""

    def wrap(fn: RewardFunction) -> RewardFunction:
        _REGISTRY[name] = fn
        return fn

    return wrap


def _builtins() -> None:
    from grpokit.data import arithmetic
    from grpokit.rewards import math_rewards

    _REGISTRY.setdefault("chain_accuracy", arithmetic.chain_accuracy)
    _REGISTRY.setdefault("math_accuracy", math_rewards.math_accuracy)
    _REGISTRY.setdefault("format", math_rewards.format_reward)


def get_reward_function(name: str) -> RewardFunction:
    """A registered name (e.g. "chain_accuracy") or an import path "package.module:function"."""
    _builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward function {name!r}; use one of {sorted(_REGISTRY)} or an import path 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {name!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn
