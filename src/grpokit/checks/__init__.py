"""The config checks that need the registries, before any model loads: every name a config gives a
registered piece (rewards, grpo.loss and the advantages, rollout.is_correction, rollout.engine,
rollout.tool, task.name, the report_to trackers) names one, with arguments it accepts.

grpokit.config is a leaf that every layer reads: it checks what the config's own values say
(types, bounds, keys that go together) and imports no registry. The registries sit above it, and
so does this module, above tasks, rewards, rollout, run and tools: `load_config` here is
grpokit.config's with these checks added, which is how the CLI, `grpokit.train(...)` and a resumed
run read a config. A config built another way (`Config(...)`, grpokit.config.read_config) is
checked whole by `validate`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

from grpokit import config as _config
from grpokit.config import Config, ConfigError, RewardConfig, RolloutConfig
from grpokit.config.schema import failed
from grpokit.math import registry
from grpokit.rewards.process import is_process_reward
from grpokit.rewards.registry import reward_function
from grpokit.rollout.registry import ENGINES, engine_spec  # the package import registers every engine
from grpokit.run.loggers import TrackerError, check_trackers
from grpokit.tasks.registry import TASKS, task_class
from grpokit.tools import TOOLS  # the package import registers every tool

__all__ = ["check_names", "load_config", "name_problems", "validate"]


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None, cls=Config,
                announce_renames: bool = True):
    """grpokit.config.read_config, with the names checked against the registries too (check_names):
    a config as a run reads it, every problem a ConfigError before any model loads."""
    return _config.read_config(path, overrides, cls, announce_renames, check=check_names if cls is Config else None)


def validate(config: Config) -> None:
    """The first problem of `config` as a ConfigError: grpokit.config.check_values' (its own values),
    then check_names' (the names it gives registered pieces)."""
    _config.check_values(config)
    check_names(config)


def check_names(config: Config) -> None:
    """The first name of `config` that no registry knows (or arguments its piece refuses) as a
    ConfigError. A named task's own reward replaces the default rewards first."""
    _take_task_reward(config)
    problem = next(name_problems(config), None)
    if problem is not None:
        raise ConfigError(problem)


def name_problems(config: Config) -> Iterator[str]:
    """One message per name that names nothing registered, in the config tree's order (grpo,
    rewards, rollout, report_to), then the rules between rewards and the task they grade."""
    g = config.grpo
    yield from _refusal(lambda: registry.check_args(registry.policy_loss(g.loss), g.loss_args, "grpo.loss_args"))
    yield from _refusal(lambda: registry.advantage(g.advantage))
    yield from _refusal(lambda: registry.process_advantage(g.process_advantage))
    for i, reward in enumerate(config.rewards):
        # a typo would otherwise surface only after the policy has loaded, minutes in for a 7B model
        yield from _refusal(lambda: reward_function(reward.name, reward.args), f"rewards[{i}]: ")
    yield from _rollout_problems(config.rollout)
    try:
        check_trackers(config.report_to)
    except TrackerError as err:
        yield str(err)
    yield from _process_reward_problems(config)
    yield from _task_problems(config)


def _refusal(check: Callable[[], object], prefix: str = "") -> list[str]:
    """[the message of the ValueError `check()` raises, after `prefix`], or [] when it raises none:
    a name that a registry (rewards, losses, engines) does not know, or arguments it refuses."""
    try:
        check()
    except ValueError as err:
        return [f"{prefix}{err}"]
    return []


def _rollout_problems(r: RolloutConfig) -> Iterator[str]:
    """rollout.tool and rollout.is_correction name registered pieces that accept their arguments, and
    rollout.engine an engine the rollout keys suit."""
    if r.tool and r.tool not in TOOLS:
        yield f"rollout.tool={r.tool!r} is not a registered tool; registered: {', '.join(sorted(TOOLS))}"
    if r.tool in TOOLS:
        try:
            TOOLS[r.tool](**r.tool_args)
        except (TypeError, ValueError) as err:
            yield f"rollout.tool_args={r.tool_args} do not suit the {r.tool} tool: {err}"
    if r.off_policy_correction() is not None:
        yield from _refusal(lambda: registry.check_args(registry.is_correction(r.off_policy_correction()),
                                                       r.correction_args(), "rollout.is_args"))
    yield from _engine_problems(r)


def _engine_problems(r: RolloutConfig) -> Iterator[str]:
    """rollout.engine names a registered engine whose package is installed, and the engine keys suit it."""
    try:
        spec = engine_spec(r.engine)
    except ValueError as err:
        yield str(err)
        return
    if spec.package and importlib.util.find_spec(spec.package) is None:
        yield (f"rollout.engine={spec.name} but {spec.package} is not installed: {spec.install} "
               f"(or use rollout.engine=hf)")
    if r.workers and not spec.runs_in_worker:
        able = " or ".join(sorted(name for name, other in ENGINES.items() if other.runs_in_worker))
        yield (f"rollout.engine={r.engine} cannot run in a rollout worker (rollout.workers={r.workers}): "
               f"use rollout.engine={able}, or rollout.workers=0 with rollout.mode=sync")
    if spec.check is not None:  # the engine's own rules (a library version it needs, ...)
        yield from spec.check(r)
    if r.tensor_parallel_size > 1 and not spec.tensor_parallel:
        tp_engines = " or ".join(sorted(name for name, other in ENGINES.items() if other.tensor_parallel))
        yield (f"rollout.tensor_parallel_size={r.tensor_parallel_size} applies to rollout.engine={tp_engines} "
               f"only (rollout.engine={r.engine}): set it to 1, or use the {tp_engines} engine")


def _process_reward_problems(config: Config) -> Iterator[str]:
    """Process rewards under `rewards` (step scores, eq. 6) with the keys that cannot go with them."""
    names = [r.name for r in config.rewards if _is_process_reward(r)]
    if not names:
        return
    yield from failed([
        (len(names) == 1, f"rewards {names} are all process rewards (step scores); eq. 6 takes one set of steps: "
                          f"keep one of them"),
        (config.reward_model.kind != "process",
         f"rewards names the process reward {names[0]!r} and reward_model.kind=process gives step scores too: "
         f"keep one of them"),
        (config.algo == "grpo", f"the process reward {names[0]!r} needs algo=grpo: PPO's critic takes one scalar "
                                f"reward"),
        (config.grpo.scale_rewards, f"grpo.scale_rewards=false is not defined for the process reward {names[0]!r}: "
                                    f"eq. 6 normalises step rewards by their group std"),
    ])


def _is_process_reward(reward: RewardConfig) -> bool:
    """Whether a rewards entry names a process reward (a name that names nothing is the entry's own problem)."""
    try:
        return is_process_reward(reward_function(reward.name, reward.args))
    except ValueError:
        return False


def _named_task(config: Config):
    """The task class task.name names, None for auto; ValueError when it names none."""
    return None if config.task.name == "auto" else task_class(config.task.name)


def _take_task_reward(config: Config) -> None:
    """The task's own reward replaces the default rewards (chain_accuracy, which would score its
    answers by chain's rule, zero for every GSM8K answer): a named task's, or auto's when the data names
    files (the math task). A task.name that names no task is left to _task_problems."""
    try:
        cls = task_class(config.task.resolved_name(config.data))
    except ValueError:
        return
    if cls is not None and cls.reward and config.rewards == [RewardConfig()]:
        config.rewards = [RewardConfig(name=cls.reward)]


def _task_problems(config: Config) -> Iterator[str]:
    """task.name names a task, and no reward is another task's grader."""
    try:
        cls = _named_task(config)
    except ValueError as err:
        yield f"task.name: {err}"
        return
    if cls is None:
        return
    graders = {t.reward: t.name for t in TASKS.values() if t is not cls and t.reward and t.reward != cls.reward}
    for i, reward in enumerate(config.rewards):
        if reward.name in graders:
            fix = f"--rewards='[{{name: {cls.reward}}}]'" if cls.reward else "a reward that grades it"
            yield (f"rewards[{i}]: {reward.name} grades the {graders[reward.name]} task, not "
                   f"task.name={config.task.name}: use {fix}")
