"""Combine weighted reward functions into one reward per sample, isolating failures."""

from __future__ import annotations

import inspect
import math
import threading
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from grpokit.data.templates import MESSAGES
from grpokit.rewards.process import is_process_reward, run_process_reward
from grpokit.rewards.registry import RewardFunction, reward_function


@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFunction
    weight: float = 1.0
    timeout_s: float | None = None  # None: run in the caller's thread with no time limit


def configured_rewards(config, tokenizer=None) -> list[WeightedReward]:
    """The config's rewards list, made; a reward factory that counts tokens (overlong_penalty) gets `tokenizer`."""
    return [WeightedReward(r.name, reward_function(r.name, r.args, tokenizer), r.weight, r.timeout_s)
            for r in config.rewards]


class RewardTimeout(TimeoutError):
    """A reward function did not return within its timeout."""


def call_with_timeout(fn, timeout_s: float | None, **kwargs):
    """fn(**kwargs), giving up after timeout_s seconds. A function that hangs is left running in
    a daemon thread (Python cannot kill a thread); its late result is discarded."""
    if timeout_s is None:
        return fn(**kwargs)
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # re-raised in the caller's thread below
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="grpokit-reward")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"no result within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class RewardResult:
    """total: [N] weighted sum (NaN where any function failed); valid: [N] bool;
    per_function: [N] raw scores of each function (NaN where it failed);
    errors: the first error message of each function that raised or misbehaved."""

    total: torch.Tensor
    valid: torch.Tensor
    per_function: dict[str, torch.Tensor]
    errors: dict[str, str]
    timeouts: dict[str, int] = field(default_factory=dict)  # samples lost to a timeout, per function
    step_scores: list | None = None  # StepScores per sample (None where refused), from a process reward
    # what the functions logged through TRL's log_metric (a number) and log_extra (a value per sample),
    # as "rewards/<function>/<name>": the step's metrics row carries them
    logged: dict[str, object] = field(default_factory=dict)

    def function_means(self) -> dict[str, float]:
        """Mean of each function over the samples it scored (NaN if it scored none)."""
        out = {}
        for name, scores in self.per_function.items():
            ok = ~torch.isnan(scores)
            out[name] = float(scores[ok].mean()) if ok.any() else float("nan")
        return out

    def take(self, rows: torch.Tensor) -> "RewardResult":
        """The results of samples `rows` (a process reward model's step scores come later; a process
        reward function's are kept)."""
        steps = None if self.step_scores is None else [self.step_scores[i] for i in rows.tolist()]
        logged = {k: [v[i] for i in rows.tolist()] if isinstance(v, list) else v for k, v in self.logged.items()}
        return RewardResult(self.total[rows], self.valid[rows], {k: v[rows] for k, v in self.per_function.items()},
                            dict(self.errors), dict(self.timeouts), steps, logged)

    @staticmethod
    def cat(parts: list["RewardResult"]) -> "RewardResult":
        """One result of `parts`' samples in order; errors keep the first message, timeouts add up."""
        names = parts[0].per_function
        return RewardResult(torch.cat([p.total for p in parts]), torch.cat([p.valid for p in parts]),
                            {k: torch.cat([p.per_function[k] for p in parts]) for k in names},
                            {k: v for p in reversed(parts) for k, v in p.errors.items()},
                            {k: sum(p.timeouts.get(k, 0) for p in parts) for k in parts[0].timeouts},
                            None if parts[0].step_scores is None else [s for p in parts for s in p.step_scores],
                            _joined_logs(parts))

    def all_failed(self) -> list[str]:
        """Functions that failed on every sample of this batch."""
        return [name for name, s in self.per_function.items() if bool(torch.isnan(s).all())]


def _to_float(value) -> float:
    if value is None:
        return math.nan
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


def _joined_logs(parts: list[RewardResult]) -> dict[str, object]:
    """The parts' logs as one batch's: per-sample lists joined in order, numbers averaged."""
    out: dict[str, object] = {}
    for key in dict.fromkeys(k for p in parts for k in p.logged):
        values = [p.logged[key] for p in parts if key in p.logged]
        out[key] = [x for v in values for x in v] if isinstance(values[0], list) else sum(values) / len(values)
    return out


def _loggable(value):
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def trl_extras(fn, name: str, completion_ids: list[list[int]] | None, logged: dict) -> dict:
    """What TRL's trainer passes every reward function besides prompts, completions and columns, for
    those that take it (by name or **kwargs): completion_ids, and log_extra(column, values) and
    log_metric(name, value), whose values land in `logged` as rewards/<name>/<key>."""
    def log_extra(column: str, values) -> None:
        logged[f"rewards/{name}/{column}"] = [_loggable(v) for v in values]

    def log_metric(key: str, value) -> None:
        logged[f"rewards/{name}/{key}"] = float(value)

    offered = {"log_extra": log_extra, "log_metric": log_metric}
    if completion_ids is not None:
        offered["completion_ids"] = completion_ids
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return offered
    return {k: v for k, v in offered.items() if k in parameters}


def reads_text(fn) -> bool:
    """grpokit's own rewards read a completion's text whatever the prompt's format; a user's
    function gets completions as TRL gives them (a list of messages for conversational prompts)."""
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "")
    return module.split(".")[0] == "grpokit"


def assistant_messages(completions: list[str]) -> list[list[dict]]:
    """Completions in TRL's conversational format: each one a list of one assistant message."""
    return [[{"role": "assistant", "content": text}] for text in completions]


def row_columns(rows: list[dict]) -> dict[str, list]:
    """Dataset rows -> the per-field lists reward functions receive as keyword arguments."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [row.get(k) for row in rows] for k in keys}


def score_completions(
    rewards: list[WeightedReward], prompts: list[str], completions: list[str], columns: dict[str, list],
    completion_ids: list[list[int]] | None = None,
) -> RewardResult:
    """Run every reward function on the batch. A function that raises, returns the wrong
    number of scores, or gives None/NaN for a sample fails only those samples. Rows with a
    conversational prompt (columns' prompt_messages) give a user's function TRL's arguments for
    that format: the prompts' messages, and each completion as [{"role": "assistant", "content": text}].
    A function that takes them gets TRL's other arguments too (trl_extras): `completion_ids` (each
    completion's tokens, where given) and the log_extra / log_metric callables.

    A process reward (rewards/process.py) gives step_scores instead of a term of `total`; its
    per_function entry is each completion's mean step score. With no outcome reward beside it,
    `total` is its weighted mean step score, for the log only (no outcome advantage is made of it)."""
    if not rewards:
        raise ValueError("no reward functions configured; add at least one under `rewards`")
    process = [spec.name for spec in rewards if is_process_reward(spec.fn)]
    if len(process) > 1:
        raise ValueError(f"rewards {process} are all process rewards; name at most one (eq. 6 takes one set of steps)")
    n = len(completions)
    total = torch.zeros(n, dtype=torch.float64)
    per_function, errors, timeouts, step_scores, logged = {}, {}, {}, None, {}
    columns = dict(columns)
    messages = columns.pop(MESSAGES, None)
    conversational = bool(messages) and all(m is not None for m in messages)
    for spec in rewards:
        steps = None
        try:
            as_trl = conversational and not reads_text(spec.fn)
            raw = call_with_timeout(spec.fn, spec.timeout_s, prompts=messages if as_trl else prompts,
                                    completions=assistant_messages(completions) if as_trl else completions, **columns,
                                    **trl_extras(spec.fn, spec.name, completion_ids, logged))
            if raw is None or len(raw) != n:
                raise ValueError(f"returned {None if raw is None else len(raw)} scores for {n} completions")
            if process and spec.name == process[0]:
                steps, refused = run_process_reward(raw, completions)
                if refused:
                    errors[spec.name] = f"refused {len(refused)} of {n} samples; first: {refused[0]}"
                scores = torch.tensor([math.nan if s is None else sum(s.rewards) / len(s.rewards) for s in steps],
                                      dtype=torch.float64)
            else:
                scores = torch.tensor([_to_float(v) for v in raw], dtype=torch.float64)
            if getattr(raw, "timeouts", 0):  # e.g. math_accuracy: verifications that ran out of time
                timeouts[spec.name] = int(raw.timeouts)
        except Exception as err:  # a broken reward must not kill the run: mask and count it
            if isinstance(err, RewardTimeout):
                timeouts[spec.name] = n
            errors[spec.name] = f"{type(err).__name__}: {err}"
            warnings.warn(f"reward function {spec.name!r} failed on this batch: {errors[spec.name]}\n"
                          f"{traceback.format_exc(limit=3)}", stacklevel=2)
            scores = torch.full((n,), math.nan, dtype=torch.float64)
            steps = [None] * n if process and spec.name == process[0] else None
        if torch.isnan(scores).any() and spec.name not in errors:
            errors[spec.name] = f"returned None, NaN or inf for {int(torch.isnan(scores).sum())} of {n} samples"
        per_function[spec.name] = scores
        if steps is not None:
            step_scores = steps
            only_process = len(rewards) == 1
            total += spec.weight * scores if only_process else torch.where(torch.isnan(scores), math.nan, 0.0)
        else:
            total += spec.weight * scores
    valid = ~torch.isnan(total)
    return RewardResult(total=total, valid=valid, per_function=per_function, errors=errors, timeouts=timeouts,
                        step_scores=step_scores, logged=logged)
