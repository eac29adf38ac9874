"""Named pieces of the GRPO loss, registered where they are defined.

A policy loss turns per-token log-probs into the per-token policy term that `grpo_loss`
aggregates; an importance-sampling correction turns the detached ratio pi_old / pi_sampler of
each token into the weight that multiplies it; an advantage estimator turns a group's rewards
into advantages. `grpo.loss`, `rollout.is_correction` and `grpo.advantage` name them,
`grpo.loss_args` and `rollout.is_args` hold their arguments. Adding one is one new module
in this package (every module of grpokit.math is imported with the package) or in the user's
own, named by import path as `package.module:name`:

    @register_policy_loss("my_loss", check=my_check)
    def my_loss(logp, old_logp, advantages, mask, settings) -> PolicyTerm: ...

`check(args)` raises ValueError for arguments the function cannot take; the config runs it at
load, before any model loads.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LossSettings:
    """What a policy loss may read besides the tensors: the clip range of eq. 3, the importance
    level (token, or GSPO's sequence) and the loss's own arguments (grpo.loss_args)."""

    clip_eps: float = 0.2
    clip_eps_high: float = 0.2
    importance_level: str = "token"
    args: Mapping = field(default_factory=dict)


@dataclass
class PolicyTerm:
    """A policy loss's output: term [N, T] (to maximise; grpo_loss negates the aggregate), the
    ratio it used [N, T] (for the ratio_mean statistic), and where a clip was active for
    negative / positive advantages ([N, T] bools, for the clip_fraction statistics)."""

    term: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


@dataclass(frozen=True)
class Registered:
    function: Callable
    check: Callable[[Mapping], None] | None


POLICY_LOSSES: dict[str, Registered] = {}
IS_CORRECTIONS: dict[str, Registered] = {}
ADVANTAGES: dict[str, Registered] = {}
PROCESS_ADVANTAGES: dict[str, Registered] = {}


def _register(table: dict, kind: str, name: str, check):
    def decorate(function):
        if name in table and table[name].function is not function:
            raise ValueError(f"{kind} {name!r} is registered twice ({table[name].function.__module__} and "
                             f"{function.__module__})")
        table[name] = Registered(function, check)
        return function
    return decorate


def register_policy_loss(name: str, check: Callable[[Mapping], None] | None = None):
    """Register `fn(logp, old_logp, advantages, mask, settings: LossSettings) -> PolicyTerm` as `name`."""
    return _register(POLICY_LOSSES, "policy loss", name, check)


def register_is_correction(name: str, check: Callable[[Mapping], None] | None = None):
    """Register `fn(raw_weight, mask, args) -> (weight, stats)` as `name`: raw_weight is the detached
    exp(old_logp - sampling_logp) [N, T]; weight [N, T] multiplies each token's policy term; stats
    are detached scalars (shares of tokens) that the trainer logs as rollout/<key>."""
    return _register(IS_CORRECTIONS, "importance-sampling correction", name, check)


def register_advantage(name: str, check: Callable[[Mapping], None] | None = None):
    """Register `fn(rewards [N], valid [N] bool, group_size, scale: bool) -> advantages [N]` as `name`:
    outcome advantages of groups of `group_size` contiguous samples; an invalid sample (its reward
    failed) gets 0 and takes no part in its group's statistics."""
    return _register(ADVANTAGES, "advantage estimator", name, check)


def register_process_advantage(name: str, check: Callable[[Mapping], None] | None = None):
    """Register `fn(step_rewards, step_ends, num_tokens, group_size) -> advantages [N, T_max]` as `name`:
    process advantages from each completion's step rewards and the token index of each step's end
    (process_advantages' arguments, eq. 6); zero at and past each completion's length. A completion
    with no steps (its reward failed) takes no part in its group's statistics."""
    return _register(PROCESS_ADVANTAGES, "process advantage estimator", name, check)


def _lookup(table: dict, kind: str, key: str, name: str) -> Registered:
    if name in table:
        return table[name]
    if ":" in name:  # a user's own, registered when its module is imported
        module = name.split(":", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"{key}={name!r}: cannot import {module!r} ({err}); is it on PYTHONPATH?") from None
        registered = name.split(":", 1)[1]
        if registered in table:
            return table[registered]
        raise ValueError(f"{key}={name!r}: {module} imported, but it registers no {kind} named {registered!r}")
    close = difflib.get_close_matches(name, table, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{key}: unknown {kind} {name!r}{hint}; registered: {', '.join(sorted(table))}, or "
                     f"'package.module:name' for your own")


def policy_loss(name: str) -> Registered:
    return _lookup(POLICY_LOSSES, "policy loss", "grpo.loss", name)


def is_correction(name: str) -> Registered:
    return _lookup(IS_CORRECTIONS, "importance-sampling correction", "rollout.is_correction", name)


def advantage(name: str) -> Registered:
    return _lookup(ADVANTAGES, "advantage estimator", "grpo.advantage", name)


def process_advantage(name: str) -> Registered:
    return _lookup(PROCESS_ADVANTAGES, "process advantage estimator", "grpo.process_advantage", name)


def check_args(entry: Registered, args: Mapping, key: str) -> None:
    """Run the entry's own argument check; its ValueError becomes one line naming `key`."""
    if entry.check is not None:
        try:
            entry.check(dict(args))
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None


def only_keys(args: Mapping, allowed: Mapping[str, object], who: str) -> dict:
    """`allowed` (name -> default) updated with `args`; an unknown key is a ValueError naming it."""
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise ValueError(f"{who} takes {', '.join(sorted(allowed)) or 'no arguments'}; got {', '.join(unknown)}")
    return {**allowed, **args}
