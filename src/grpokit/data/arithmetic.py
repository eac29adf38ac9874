"""The demo's built-in task: short chains of integer additions and subtractions.

    prompt:     "Q: 7+5-3+9\n"
    completion: "12-3+9\n9+9\nA: 18"

Each line is one reasoning step: the chain with its first operation carried out. A step
only needs the line above it (two leading numbers and the rest copied), which a tiny model
learns reliably, while answering directly means composing every operation at once. A rule
grades each step (`check_steps`), so the same task serves outcome supervision (final
answer) and process supervision (step grades).
A fixed hash of the question decides the held-out and validation splits, so neither is ever
trained on, whatever the seed.

Tool-integrated reasoning (TIR), DeepSeekMath's second way to evaluate, in the same task:

    prompt:     "Q: 7+5-3+9 (with python)\n"
    completion: "```python\nprint(7+5-3+9)\n```\n```output\n18\n```\nA: 18"

The model writes the program and stops at "```output"; the harness runs the program and
appends its output; the model then states the answer. The tokenizer needs the characters of
those fences and of `print` (`TIR_ALPHABET`).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from grpokit.data import split as heldout_split

ALPHABET = "0123456789+-=:QA \n"
# Adds "```python", "print(...)", "```output" and "(with python)"; and a-f, without which
# transformers' stop strings (generation stops at "```output") cannot read the vocabulary.
TIR_ALPHABET = ALPHABET + "`()hinoprtuwy" + "abcdef"
_ANSWER = re.compile(r"^A: (-?\d+)\s*$", re.MULTILINE)
_CHAIN = re.compile(r"^(-?\d+)(?:[+-]\d+)+$")  # a number followed by one or more +n / -n
_HEAD = re.compile(r"^(-?\d+)([+-])(\d+)")
SPLITS = ("train", "heldout", "validation")


@dataclass(frozen=True)
class ChainSpec:
    """Shape of the problems: how many operations and how large the numbers get."""

    min_ops: int = 3
    max_ops: int = 5
    max_start: int = 20
    max_operand: int = 9
    max_value: int = 20
    heldout_percent: int = 10
    # the next share of the hash, kept out of training for choosing settings; 0 = none (the draws of
    # training questions are then those of runs before the validation split existed)
    validation_percent: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout_percent must lie in (0, 100), got {self.heldout_percent}")
        if not 0 <= self.validation_percent < 100 - self.heldout_percent:
            raise ValueError(f"validation_percent must lie in [0, {100 - self.heldout_percent}) beside "
                             f"heldout_percent={self.heldout_percent}, got {self.validation_percent}")


def is_heldout(question: str, heldout_percent: int) -> bool:
    return heldout_split.is_heldout(question, heldout_percent / 100)


def format_prompt(question: str) -> str:
    return f"Q: {question}\n"


def format_tir_prompt(question: str) -> str:
    """The tool-integrated prompt: the question, asking for a program."""
    return f"Q: {question} (with python)\n"


def format_tir_solution(question: str) -> str:
    """A tool-integrated demonstration: a program that prints the answer, its output block
    exactly as the harness appends it (grpokit.tools.python.format_tool_output), and the answer."""
    answer = solve(question)[1]
    return f"```python\nprint({question})\n```\n```output\n{answer}\n```\nA: {answer}"


def reduce_once(chain: str) -> str:
    """Carry out the first operation of a chain: "7+5-3+9" -> "12-3+9", "9+9" -> "18"."""
    m = _HEAD.match(chain)
    if m is None or not _CHAIN.match(chain):
        raise ValueError(f"not a chain question: {chain!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return f"{a + b if op == '+' else a - b}{chain[m.end():]}"


def solve(question: str) -> tuple[list[str], int]:
    """The worked steps of a question and its answer: "7+5-3+9" -> (["12-3+9", "9+9"], 18).
    Each step is the chain with one operation fewer; the answer line does the last one."""
    steps, chain = [], reduce_once(question)
    while not chain.lstrip("-").isdigit():
        steps.append(chain)
        chain = reduce_once(chain)
    return steps, int(chain)


def format_solution(question: str) -> str:
    steps, answer = solve(question)
    return "\n".join(steps + [f"A: {answer}"])


def random_question(rng: random.Random, task: ChainSpec) -> str:
    value = rng.randint(1, task.max_start)
    parts = [str(value)]
    for _ in range(rng.randint(task.min_ops, task.max_ops)):
        ops = [op for op in "+-" if 0 <= (value + (1 if op == "+" else -1)) <= task.max_value]
        op = rng.choice(ops)
        limit = task.max_value - value if op == "+" else value
        num = rng.randint(1, max(1, min(task.max_operand, limit)))
        value = value + num if op == "+" else value - num
        parts.append(f"{op}{num}")
    return "".join(parts)


def split_of(question: str, task: ChainSpec) -> str:
    """"heldout", "validation" or "train": the side of `task`'s split `question` is on."""
    return heldout_split.split_of(question, task.heldout_percent / 100, task.validation_percent / 100)


def sample_questions(n: int, seed: int, task: ChainSpec, split: str) -> list[str]:
    """`n` distinct questions of `split` ("train", "heldout" or "validation"), reproducible from `seed`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{seed}-{split}")
    seen: dict[str, None] = {}
    for _ in range(200 * n + 1000):
        q = random_question(rng, task)
        if split_of(q, task) == split:
            seen.setdefault(q)
            if len(seen) == n:
                return list(seen)
    raise TooFewQuestions(f"could not draw {n} distinct {split} questions from {task} (found {len(seen)}); "
                          "widen the task", len(seen))


class TooFewQuestions(ValueError):
    """A split holds fewer distinct questions than asked for; `found` says how many were drawn."""

    def __init__(self, message: str, found: int):
        super().__init__(message)
        self.found = found


def format_direct_answer(question: str) -> str:
    """A demonstration that states the answer with no worked steps."""
    return f"A: {solve(question)[1]}"


def make_sft_rows(questions: list[str], direct_fraction: float, seed: int) -> list[dict]:
    """SFT rows where a `direct_fraction` share of solutions skip the steps.

    Instruction data mixes worked solutions with bare answers; the model that imitates
    it sometimes reasons and sometimes guesses. Which habit pays is for RL to find out.
    """
    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"direct_fraction must lie in [0, 1], got {direct_fraction}")
    rng = random.Random(f"{seed}-direct")
    rows = make_rows(questions)
    for row in rows:
        if rng.random() < direct_fraction:
            row["solution"] = format_direct_answer(row["question"])
    return rows


def make_rows(questions: list[str]) -> list[dict]:
    """Dataset rows: the prompt, the reference answer, and the worked solution (for SFT)."""
    return [
        {"prompt": format_prompt(q), "question": q, "answer": str(solve(q)[1]), "solution": format_solution(q)}
        for q in questions
    ]


def make_tir_rows(questions: list[str]) -> list[dict]:
    """Dataset rows with tool-integrated prompts and demonstrations."""
    return [{"prompt": format_tir_prompt(q), "question": q, "answer": str(solve(q)[1]),
             "solution": format_tir_solution(q)} for q in questions]


def extract_answer(completion: str) -> str | None:
    """The final answer line's number; None if absent or if several lines disagree."""
    answers = set(_ANSWER.findall(completion))
    return answers.pop() if len(answers) == 1 else None


def check_steps(question: str, completion: str) -> list[bool]:
    """Grade each step line before the answer: it must be the line above it (the question,
    for the first) with its first operation carried out correctly and the rest copied.

    Returns one bool per line before the answer line, for process supervision. A step is
    judged against the line above it as written, so one slip is one wrong step.
    """
    grades = []
    previous = question
    for line in (ln.strip() for ln in completion.split("\n")):
        if not line or line.startswith("A:"):
            if line.startswith("A:"):
                break
            continue
        try:
            ok = line == reduce_once(previous)
        except ValueError:  # the line above is not a chain: nothing this step could reduce
            ok = False
        grades.append(ok)
        previous = line
    return grades


def step_labels(question: str, steps: list[str], answer: str) -> list[bool]:
    """Process labels for a completion split into steps (one line each): step j is right when
    it and every step before it are right, so the first wrong step and all after it are
    False (PRM800K's "first error" convention). A chain line must be the line above with its
    first operation carried out; the answer line must state the reference `answer` (a direct
    answer with no steps is right when the answer is); anything after the answer line is wrong.
    """
    labels, previous, still_right, answered = [], question, True, False
    for step in steps:
        line = step.strip()
        if answered or not line:
            ok = False
        elif line.startswith("A:"):
            ok = extract_answer(line) == str(answer).strip()
            answered = True
        else:
            try:
                ok = line == reduce_once(previous)
            except ValueError:  # the line above is not a chain: nothing this step could reduce
                ok = False
            previous = line
        still_right = still_right and ok
        labels.append(still_right)
    return labels


def one_slip(question: str, completion: str, rng: random.Random) -> str | None:
    """A hard negative for a reward model: `completion`, a right solution of `question` (worked or
    direct, in the task's layout), with one result off by 1 to 3 and every line after it carried on
    correctly from the wrong number. It reads like a right solution; one step's arithmetic is
    wrong, and so is the answer. None when `completion` is not a right solution.

    "7+5-3+9", "12-3+9\n9+9\nA: 18" -> e.g. "12-3+9\n10+9\nA: 19" (the second step slips).
    """
    steps, answer = solve(question)
    lines = [line.strip() for line in completion.strip().split("\n")]
    if lines not in (steps + [f"A: {answer}"], [f"A: {answer}"]):
        return None
    worked = len(lines) > 1
    slip_at = rng.randrange(len(steps) + 1) if worked else 0  # a step line, or the answer line
    kept = steps[:slip_at] if worked else []
    if worked and slip_at < len(steps):
        head = _HEAD.match(steps[slip_at]).group(1)
        chain = f"{int(head) + _slip(int(head), rng)}{steps[slip_at][len(head):]}"
        tail = [chain]
        chain = reduce_once(chain)
        while not chain.lstrip("-").isdigit():  # carried on correctly from the slip, as solve() would
            tail.append(chain)
            chain = reduce_once(chain)
        return "\n".join(kept + tail + [f"A: {chain}"])
    return "\n".join(kept + [f"A: {answer + _slip(answer, rng)}"])


def _slip(value: int, rng: random.Random) -> int:
    """A nonzero change of 1 to 3 that keeps a non-negative `value` non-negative."""
    return rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if value < 0 or value + d >= 0])


def shows_steps(completion: str) -> bool:
    """True when the completion works through at least one step line before answering."""
    for line in completion.split("\n"):
        if line.startswith("A:"):
            return False
        if _CHAIN.match(line.strip()):
            return True
    return False


def worked_rates(completions: list[str], correct: list[bool]) -> dict[str, float]:
    """Greedy rates by how each completion answers: the share that shows its steps, and the share
    right among the worked ones and among the direct ones (NaN where there are none). Accuracy is
    their mix, so a pi_SFT that answers directly half the time can hide worked arithmetic that is
    worse, and worked arithmetic is what RL builds on (after RL nearly every answer is worked)."""
    worked = [shows_steps(c) for c in completions]
    right_worked = sum(ok for w, ok in zip(worked, correct) if w)
    right_direct = sum(ok for w, ok in zip(worked, correct) if not w)
    n_worked, n_direct = sum(worked), len(worked) - sum(worked)
    return {"shows its steps": n_worked / max(1, len(worked)),
            "right if worked": right_worked / n_worked if n_worked else math.nan,
            "right if direct": right_direct / n_direct if n_direct else math.nan}


def chain_accuracy(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """Rule-based outcome reward: 1.0 when the final answer equals the reference, else 0.0."""
    return [1.0 if extract_answer(c) == str(a).strip() else 0.0 for c, a in zip(completions, answer)]
