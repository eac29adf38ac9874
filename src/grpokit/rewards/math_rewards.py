"""Rewards for math word problems (GSM8K, MATH), with TRL's signature:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

math_accuracy   1.0 when the completion's final answer equals the `answer` column's reference
                (checked with math-verify: 0.5 = \\frac{1}{2}, "1,000" = 1000, "$18" = 18), else 0.0
format_reward   1.0 when the completion states a final answer exactly once, else 0.0
overlong_penalty(max_length, soft_cache)   DAPO's soft length penalty, in characters or tokens (a reward
                factory: a config gives it `args`)

Equivalence checks run in worker processes (see verify_pool) so that no input can hang or
crash the caller, whatever thread it calls from. A check that runs out of time scores 0.0 and
is counted: `math_accuracy_with_stats` returns the counts with the scores (an AccuracyResult);
`math_accuracy` is the same call returning only the scores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from grpokit.data.answers import answer_count, clean_answer, final_answers
from grpokit.rewards.verify_pool import VerifierPool

# A final answer longer than this is not an answer; it is never sent to math-verify.
MAX_ANSWER_CHARS = 1000
# More distinct final answers than this score 0.0 unchecked (each must match the reference).
MAX_ANSWERS = 4

_default_pool: VerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_verifier() -> VerifierPool:
    """The process-wide pool `math_accuracy` uses unless given `verifier=` (started on first use)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = VerifierPool()
        return _default_pool


@dataclass(frozen=True)
class AccuracyResult:
    """scores: [N] 1.0 or 0.0. Of the 0.0 scores: `timeouts` ran out of verification time,
    `errors` math-verify could not judge, `no_answer` stated no usable final answer.
    `verified`: samples judged by math-verify (the rest matched the reference's text exactly,
    or had no answer)."""

    scores: list[float]
    timeouts: int = 0
    errors: int = 0
    no_answer: int = 0
    verified: int = 0


def math_accuracy_with_stats(
    prompts: list[str],
    completions: list[str],
    answer: list[str],
    *,
    verifier: VerifierPool | None = None,
    **_,
) -> AccuracyResult:
    """Score each completion against its reference answer and count why samples scored 0.

    A completion passes when it states at least one and at most MAX_ANSWERS distinct final
    answers and every one of them is equivalent to the reference; several different values
    therefore never pass. Identical (reference, answers) pairs in a batch are checked once.
    """
    if len(answer) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} reference answers")
    scores = [0.0] * len(completions)
    pending: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    no_answer = 0
    for i, (completion, reference) in enumerate(zip(completions, answer)):
        preds = final_answers(completion)
        gold = clean_answer(str(reference))
        if not preds or len(preds) > MAX_ANSWERS or any(len(p) > MAX_ANSWER_CHARS for p in preds):
            no_answer += 1
        elif not gold:
            raise ValueError(f"reference answer {i} is empty: {reference!r}")
        elif all(p == gold for p in preds):  # same text: equivalent without asking sympy
            scores[i] = 1.0
        else:
            pending.setdefault((gold, tuple(preds)), []).append(i)
    counts = {"timeout": 0, "error": 0}
    if pending:
        pool = verifier if verifier is not None else default_verifier()
        for (_, indices), verdict in zip(pending.items(), pool.run([(g, list(p)) for g, p in pending])):
            for i in indices:
                scores[i] = 1.0 if verdict == "yes" else 0.0
            if verdict in counts:
                counts[verdict] += len(indices)
    verified = sum(len(indices) for indices in pending.values())
    return AccuracyResult(scores, counts["timeout"], counts["error"], no_answer, verified)


class Scores(list):
    """A reward function's list of scores that also says how many samples ran out of time;
    `score_completions` logs it as rewards/timeouts. Still a plain list to any other caller."""

    timeouts: int = 0


def math_accuracy(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 when the completion's final answer is equivalent to the reference `answer`, else 0.0.
    Scores of `math_accuracy_with_stats`; use that to log timeouts."""
    result = math_accuracy_with_stats(prompts, completions, answer, **columns)
    scores = Scores(result.scores)
    scores.timeouts = result.timeouts
    return scores


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1.0 when the completion states its final answer exactly once (one \\boxed{}, or one
    ####, "The answer is" or "A:" line), else 0.0."""
    return [1.0 if answer_count(c) == 1 else 0.0 for c in completions]


def reward_factory(example_args: str):
    """Decorator: `fn(**args)` makes a reward function (it is not one itself); `example_args`
    shows a config's `args` for it, for error messages."""

    def wrap(fn):
        fn.example_args = example_args
        return fn

    return wrap


@reward_factory("{max_length: 1024, soft_cache: 256}")
def overlong_penalty(max_length: int, soft_cache: int, tokenizer=None) -> Callable[..., list[float]]:
    """DAPO's soft overlong penalty as a reward function.

    Length is in characters, or in tokens when a tokenizer (anything with
    `encode(text, add_special_tokens=False)`) is given. Up to max_length - soft_cache: 0.0;
    then falling linearly to -1.0 at max_length; beyond it: -1.0.

    In a config: `rewards: [{name: overlong_penalty, args: {max_length: 1024, soft_cache: 256}}]`;
    a run counts the length in the policy's tokens.
    """
    if not 0 <= soft_cache <= max_length:
        raise ValueError(f"need 0 <= soft_cache <= max_length, got {soft_cache}, {max_length}")
    free = max_length - soft_cache

    def length(text: str) -> int:
        return len(text) if tokenizer is None else len(tokenizer.encode(text, add_special_tokens=False))

    def penalty(prompts: list[str], completions: list[str], **_) -> list[float]:
        out = []
        for c in completions:
            n = length(c)
            out.append(0.0 if n <= free else -1.0 if n > max_length else (free - n) / soft_cache)
        return out

    return penalty
