"""Reward functions by name: built-ins, or any `package.module:function` a config names. Modules
are found on sys.path and in the working directory, so a reward file next to the config works
without PYTHONPATH. A reward factory (overlong_penalty) makes the reward function from the
config entry's `args`."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable

from grpokit.data import arithmetic
from grpokit.rewards import chain_steps, gsm8k_steps, math_rewards

RewardFunction = Callable[..., list]

_REGISTRY: dict[str, RewardFunction] = {}


def register_reward(name: str):
    """Decorator: make `fn` available to configs as `name`."""

    def wrap(fn: RewardFunction) -> RewardFunction:
        _REGISTRY[name] = fn
        return fn

    return wrap


def unregister_reward(name: str) -> None:
    """Remove `name` (grpokit.train registers a caller's functions for the length of one run)."""
    _REGISTRY.pop(name, None)


def _builtins() -> None:
    _REGISTRY.setdefault("chain_accuracy", arithmetic.chain_accuracy)
    _REGISTRY.setdefault("math_accuracy", math_rewards.math_accuracy)
    _REGISTRY.setdefault("format", math_rewards.format_reward)
    _REGISTRY.setdefault("overlong_penalty", math_rewards.overlong_penalty)
    _REGISTRY.setdefault("chain_steps", chain_steps.chain_steps)  # process rewards (eq. 6): step scores
    _REGISTRY.setdefault("gsm8k_steps", gsm8k_steps.gsm8k_steps)


def reward_names() -> list[str]:
    """The names a config may use without an import path."""
    _builtins()
    return sorted(_REGISTRY)


def get_reward_function(name: str) -> RewardFunction:
    """A registered name (e.g. "chain_accuracy") or an import path "package.module:function"."""
    _builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise ValueError(unknown_name(name, sorted(_REGISTRY)))
    module_name, _, attr = name.partition(":")
    module = import_user_module(module_name, name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def unknown_name(name: str, names: list[str], what: str = "reward function", known: str = "built-in",
                 member: str = "function") -> str:
    """The error for a `what` that is neither one of `names` nor an import path: the closest name,
    or the colon an import path lacks."""
    if "." in name:  # an import path written without its colon
        module, _, attr = name.rpartition(".")
        hint = f" (an import path puts a colon before the {member}: '{module}:{attr}')"
    else:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown {what} {name!r}{hint}; the {known} ones are {', '.join(names)}, "
            f"or name your own as 'package.module:{member}'")


def import_user_module(module_name: str, name: str, what: str = "reward function"):
    """`module_name`, from sys.path or else the working directory (last, so it shadows nothing),
    for the import path `name` of a `what`."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {name!r}: cannot import module {module_name!r} ({err}); looked in "
                         f"the working directory {os.getcwd()} and on PYTHONPATH") from None
    except Exception as err:  # the module itself is broken: say how, without a traceback
        raise ValueError(f"{what} {name!r}: importing module {module_name!r} failed with "
                         f"{type(err).__name__}: {err}") from None


def reward_function(name: str, args: dict | None = None, tokenizer=None) -> RewardFunction:
    """The reward function a config's rewards entry names: the function itself, or what a reward
    factory makes from `args` (and the policy's `tokenizer`, when the factory takes one)."""
    fn = get_reward_function(name)
    example = getattr(fn, "example_args", None)
    takes_completions = "completions" in _parameters(fn)
    if not args and (example is None or takes_completions):
        return fn
    if takes_completions:
        raise ValueError(f"reward {name!r} scores completions itself and takes no args: remove its args")
    kwargs = dict(args or {})
    if tokenizer is not None and "tokenizer" in _parameters(fn):
        kwargs.setdefault("tokenizer", tokenizer)
    usage = f"write {{name: {name}, args: {example or '{...}'}}}"
    try:
        made = fn(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward {name!r} is made from its args, and args {args or {}} do not make it ({err}): "
                         f"{usage}") from None
    if not callable(made):
        raise ValueError(f"reward {name!r} with args {args} returned {type(made).__name__}, not a reward function")
    return made


def _parameters(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return set()
