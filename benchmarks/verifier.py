"""How often the math-answer reward agrees with reference labels, and how fast it is.

    python benchmarks/verifier.py [--data DIR] [--show N]

DIR (default: $GRPOKIT_DATA, else <repo>/../shared/data) holds the reference data:

  MATH-500   math500/test.jsonl: each reference solution, scored against the row's `answer`;
             every one should pass.
  MATH test  math/test.jsonl: each reference solution, scored against its own last boxed
             answer rewritten in another surface form (perturb()); every one should pass,
             except solutions that box several different answers (the reward refuses those).
  GSM8K      gsm8k/example_model_solutions.jsonl: four model samples per question, scored
             against the ground truth's "A: <answer>"; the score should equal the authors'
             is_correct label.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpokit.data.answers import extract_final_answer, final_answers, math_reference
from grpokit.rewards.math_rewards import math_accuracy_with_stats
from grpokit.rewards.verify_pool import VerifierPool

REPO = Path(__file__).resolve().parents[1]
GSM8K_SAMPLES = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
BATCH = 256


def default_data_dir() -> Path:
    return Path(os.environ.get("GRPOKIT_DATA") or REPO.parent / "shared" / "data")


def load_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Rewrites that keep an answer's value: (pattern, replacement), applied in order.
_PERTURBATIONS = [
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\left\s*([(\[])"), r"\1"),
    (re.compile(r"\\right\s*([)\]])"), r"\1"),
    (re.compile(r",\\!\s*"), ","),  # 11,\! 111 -> 11,111: a thousands separator stays one
    (re.compile(r"\\[!,;]"), ""),
    (re.compile(r"\^\s*\{?\\circ\}?"), ""),
    # \frac{3}{4} -> 3/4 only where it stands alone: not in 2 \frac{1}{2} (a mixed number),
    # \frac{3}{4}\pi or x^\frac{1}{2}, where a slash would change the value.
    (re.compile(r"(?<![\w}^_])(?<!\d )\\frac\{(\d+)\}\{(\d+)\}(?![\w\\({]| [\w\\])"), r"\1/\2"),
    (re.compile(r",(?![\d}]{3})\s*"), ", "),
    (re.compile(r"\s*([=+])\s*"), r" \1 "),
    (re.compile(r"(?<![\\ndn])\{([^{}\\]*)\}"), r"{ \1 }"),  # not \{, \begin{, \end{
    (re.compile(r"^(-?\d+)$"), r"\1.0"),
]


def perturb(answer: str) -> str:
    """The same answer in another surface form: \\dfrac -> \\frac, no \\left/\\right, no thin
    spaces or degree signs, 3/4 for \\frac{3}{4}, other spacing around commas, operators and
    inside braces, 42.0 for 42."""
    for pattern, replacement in _PERTURBATIONS:
        answer = pattern.sub(replacement, answer)
    return answer.strip()


@dataclass
class Check:
    name: str
    checked: int = 0
    agreed: int = 0
    seconds: float = 0.0
    timeouts: int = 0
    verified: int = 0  # samples that math-verify judged (the rest matched the reference's text)
    disagreements: list[str] = field(default_factory=list)


def score(check: Check, completions: list[str], answers: list[str], expected: list[float], labels: list[str],
          pool: VerifierPool) -> Check:
    """Score in batches like a trainer would; count agreement with `expected`."""
    start = time.perf_counter()
    for lo in range(0, len(completions), BATCH):
        hi = lo + BATCH
        result = math_accuracy_with_stats([""] * len(completions[lo:hi]), completions[lo:hi], answers[lo:hi],
                                          verifier=pool)
        check.timeouts += result.timeouts
        check.verified += result.verified
        for got, want, label in zip(result.scores, expected[lo:hi], labels[lo:hi]):
            check.checked += 1
            if got == want:
                check.agreed += 1
            else:
                check.disagreements.append(f"{label}: reward {got}, expected {want}")
    check.seconds += time.perf_counter() - start
    return check


def check_math500(rows: list[dict], pool: VerifierPool) -> Check:
    labels = [r.get("unique_id", str(i)) for i, r in enumerate(rows)]
    answers = [r["answer"] for r in rows]
    return score(Check("MATH-500"), [r["solution"] for r in rows], answers, [1.0] * len(rows), labels, pool)


def check_math_test(rows: list[dict], pool: VerifierPool) -> Check:
    labels = []
    for i, r in enumerate(rows):
        several = len(final_answers(r["solution"]))
        note = f" [boxes {several} different answers: refused by design]" if several > 1 else ""
        labels.append(r.get("unique_id", str(i)) + note)
    answers = [perturb(math_reference(r["solution"])) for r in rows]
    return score(Check("MATH test (perturbed)"), [r["solution"] for r in rows], answers, [1.0] * len(rows),
                 labels, pool)


def check_gsm8k(rows: list[dict], pool: VerifierPool) -> Check:
    completions, answers, expected, labels = [], [], [], []
    for i, row in enumerate(rows):
        gold = extract_final_answer(row["ground_truth"])
        if gold is None:
            raise ValueError(f"GSM8K row {i}: ground truth has no final answer")
        for key in GSM8K_SAMPLES:
            completions.append(row[key]["solution"])
            answers.append(gold)
            expected.append(1.0 if row[key]["is_correct"] else 0.0)
            labels.append(f"row {i} {key}")
    return score(Check("GSM8K samples"), completions, answers, expected, labels, pool)


CHECKS = (
    ("math500/test.jsonl", check_math500),
    ("math/test.jsonl", check_math_test),
    ("gsm8k/example_model_solutions.jsonl", check_gsm8k),
)


def run_all(data: Path, pool: VerifierPool) -> list[Check]:
    return [check(load_jsonl(data / rel), pool) for rel, check in CHECKS]


def format_table(checks: list[Check]) -> str:
    total = Check("total")
    for c in checks:
        for name in ("checked", "agreed", "seconds", "timeouts", "verified"):
            setattr(total, name, getattr(total, name) + getattr(c, name))
    lines = [f"{'data':<24}{'checked':>9}{'agreed':>9}{'rate':>9}{'seconds':>9}{'verif/s':>9}"
             f"{'by m-v':>8}{'timeouts':>10}"]
    for c in [*checks, total]:
        lines.append(f"{c.name:<24}{c.checked:>9}{c.agreed:>9}{c.agreed / max(c.checked, 1):>9.2%}"
                     f"{c.seconds:>9.1f}{c.checked / max(c.seconds, 1e-9):>9.0f}{c.verified:>8}{c.timeouts:>10}")
    lines.append("verif/s: samples scored per second; by m-v: samples judged by math-verify, the rest "
                 "matched the reference's text exactly (or stated no answer)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=default_data_dir(), help="reference data directory")
    parser.add_argument("--show", type=int, default=20, help="disagreements to print per data set")
    args = parser.parse_args(argv)
    missing = [rel for rel, _ in CHECKS if not (args.data / rel).is_file()]
    if missing:
        print(f"reference data not found under {args.data}: missing {', '.join(missing)}\n"
              f"pass --data DIR (or set GRPOKIT_DATA) to the folder holding math500/, math/ and gsm8k/",
              file=sys.stderr)
        return 2
    pool = VerifierPool()
    try:
        pool.run([("1", ["1.0"])])  # start the workers outside the timings
        checks = run_all(args.data, pool)
    finally:
        pool.close()
    print(format_table(checks))
    for c in checks:
        for line in c.disagreements[: args.show]:
            print(f"  {c.name}: {line}")
        if len(c.disagreements) > args.show:
            print(f"  {c.name}: ... {len(c.disagreements) - args.show} more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
