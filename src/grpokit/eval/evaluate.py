"""Greedy accuracy, pass@k and maj@k of a model on rows with reference answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from math import comb

from grpokit.rollout import SamplingParams, sample_groups
from grpokit.threads import ThreadTuner


@dataclass
class EvalResult:
    greedy_accuracy: float
    pass_at_k: float
    maj_at_k: float
    k: int
    num_questions: int
    greedy_completions: list[str] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["greedy_completions"]
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_answer(answers: list[str | None]) -> str | None:
    """Most frequent non-missing answer; ties go to the answer seen first."""
    votes = Counter(a for a in answers if a is not None)
    return max(votes, key=lambda a: (votes[a], -answers.index(a))) if votes else None


def _string_equal(predicted: str, reference: str) -> bool:
    return predicted.strip() == reference.strip()


def evaluate(
    model,
    tokenizer,
    rows: list[dict],
    extract_answer: Callable[[str], str | None],
    max_new_tokens: int,
    k: int = 8,
    temperature: float = 1.0,
    batch_size: int = 512,
    equivalent: Callable[[str, str], bool] = _string_equal,
    answer_key: str = "answer",
) -> EvalResult:
    """Greedy accuracy, and pass@k / maj@k from k samples at `temperature`.

    rows: dicts with "prompt" and `answer_key`. A completion is correct when its extracted
    answer is `equivalent` to the reference; maj@k votes over the extracted answers.
    """
    if not rows:
        raise ValueError("evaluate got no rows")

    def correct(answer: str | None, row: dict) -> bool:
        return answer is not None and equivalent(answer, str(row[answer_key]))

    prompts = [r["prompt"] for r in rows]
    on_cpu = next(model.parameters()).device.type == "cpu"
    # Each token generate makes is a step for the thread tuner (it changes speed, not results).
    with ThreadTuner(enabled=None if on_cpu else False) as tuner, tuner.per_forward(model):
        greedy = sample_groups(model, tokenizer, prompts, 1, SamplingParams(max_new_tokens, 0.0, 1.0, batch_size))
        sampled = sample_groups(model, tokenizer, prompts, k,
                                SamplingParams(max_new_tokens, temperature, 1.0, batch_size))
    greedy_hits = sum(correct(extract_answer(c), row) for c, row in zip(greedy.completions, rows))
    passes = majority = 0.0
    for q, row in enumerate(rows):
        answers = [extract_answer(c) for c in sampled.completions[q * k : (q + 1) * k]]
        passes += pass_at_k(k, sum(correct(a, row) for a in answers), k)
        majority += correct(majority_answer(answers), row)
    n = len(rows)
    return EvalResult(greedy_hits / n, passes / n, majority / n, k, n, greedy.completions)
