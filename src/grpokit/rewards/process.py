"""Process rewards: reward functions that score each reasoning step (process supervision, eq. 6).

A process reward follows the reward contract, marked with `@process_reward`, and returns one
StepScores per completion (None for a completion it cannot score):

    @process_reward
    def my_steps(prompts, completions, **columns) -> list[StepScores | None]: ...

StepScores.char_ends are character offsets into the completion, one per step, where each step ends;
the trainer maps them onto the policy's tokens (learned.policy_step_ends), exactly as for a process
reward model. Scores whose step ends are not strictly increasing or fall outside the completion are
refused for that sample: the sample fails like any reward that could not score it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from grpokit.data.reward_data import split_steps

PROCESS_MARK = "grpokit_process_reward"


@dataclass
class StepScores:
    """A verdict on each step of one completion (from a process reward model or a process reward function)."""

    rewards: list[float]  # one score per step (a process reward model's: the predicted chance the step is right)
    char_ends: list[int]  # end of each step, as a character offset into the completion
    has_delimiter: bool = True  # False: the completion had no step delimiter and was scored as one step


def process_reward(fn):
    """Decorator: `fn` returns StepScores per completion; a config's `rewards` entry that names it
    gives process supervision (eq. 6) instead of one outcome reward."""
    setattr(fn, PROCESS_MARK, True)
    return fn


def is_process_reward(fn) -> bool:
    return bool(getattr(fn, PROCESS_MARK, False))


def step_char_ends(pieces: list[str]) -> list[int]:
    """Where each step ends, as a character offset into the joined completion."""
    return list(itertools.accumulate(len(piece) for piece in pieces))


def line_steps(completion: str, delimiter: str = "\n") -> tuple[list[str], bool]:
    """(steps, has_delimiter): the completion split after each delimiter as a process reward model
    splits it (blank lines join a neighbour); one step, possibly empty, when it has no delimiter."""
    return split_steps(completion, delimiter) or [completion], delimiter in completion


def checked(scores, completion: str) -> StepScores:
    """`scores` as StepScores, or a ValueError saying why it cannot be placed on `completion`."""
    if not isinstance(scores, StepScores):
        raise ValueError(f"returned {type(scores).__name__}, not StepScores")
    ends, values = list(scores.char_ends), list(scores.rewards)
    if len(ends) != len(values):
        raise ValueError(f"{len(values)} step scores but {len(ends)} step ends")
    if not ends:
        raise ValueError("no steps: give a completion without steps one step ending at len(completion)")
    lowest = 0 if not completion else 1  # an empty completion's one step ends at 0; others hold text
    if any(not isinstance(e, int) or isinstance(e, bool) for e in ends):
        raise ValueError(f"step ends {ends} must be ints (character offsets)")
    if ends[0] < lowest or ends[-1] > len(completion) or any(b <= a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"step ends {ends} must increase strictly within [{lowest}, {len(completion)}] "
                         f"(the completion's length)")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"step scores {values} are not numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"step scores {values} contain NaN or infinity")
    return StepScores(values, ends, bool(scores.has_delimiter))


def run_process_reward(raw, completions: list[str]) -> tuple[list[StepScores | None], list[str]]:
    """(each completion's checked StepScores, None where refused; the reasons for the refusals)."""
    out, reasons = [], []
    for i, (scores, completion) in enumerate(zip(raw, completions)):
        if scores is None:
            out.append(None)
            reasons.append(f"completion {i}: returned None")
            continue
        try:
            out.append(checked(scores, completion))
        except ValueError as err:
            out.append(None)
            reasons.append(f"completion {i}: {err}")
    return out, reasons
