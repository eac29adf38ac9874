"""Countdown: reach a target from 3 or 4 given numbers with + - * / and parentheses, each given
number used at most once (as often as it is given).

    prompt:     "Numbers: 3 7 25 2\nTarget: 46\n"
    completion: "A: 25*2-7+3"

Questions come from seeds, as the chain task's do: a question is drawn by building a random
expression over some of its numbers, so every question is solvable and that expression is its
demonstration. A fixed hash of the numbers (in any order) and the target decides the held-out
split, so held-out questions are never trained on, whatever the seed.

Grading is exact and safe: `ast` parses the answer, which may hold only whole numbers written in
digits, + - * / and parentheses, and nothing in it is ever run; Fractions compute its value, so
7/2*2 is 7, and a division by zero is a wrong answer. RL grades by the same rule: the task's
reward, countdown_accuracy here, replaces the default rewards of a config that names the task.
The built-in tiny model spells the prompt's letters, * and / with model.tiny.alphabet=ascii.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from grpokit.data.arithmetic import SPLITS, TooFewQuestions
from grpokit.data.split import split_of
from grpokit.errors import ConfigError
from grpokit.tasks.base import TaskData, validation_questions
from grpokit.tasks.registry import register_task

if TYPE_CHECKING:
    from grpokit.config import Config

MIN_NUMBERS, MAX_NUMBERS = 3, 4
MAX_NUMBER = 25  # the given numbers lie in [1, MAX_NUMBER]
MAX_TARGET = 100  # targets lie in [1, MAX_TARGET]
MAX_ANSWER_CHARS = 200  # a longer answer is wrong unread (four numbers need far fewer)
_ANSWER = re.compile(r"^A:(.*)$", re.MULTILINE)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class Question:
    numbers: tuple[int, ...]
    target: int
    solution: str  # one expression that reaches the target: the demonstration

    @property
    def key(self) -> str:
        """What the held-out split and de-duplication go by: the order of the numbers is no new question."""
        return f"{' '.join(map(str, sorted(self.numbers)))} -> {self.target}"


def format_prompt(numbers, target: int) -> str:
    return f"Numbers: {' '.join(map(str, numbers))}\nTarget: {target}\n"


def _join(left: tuple[str, int], op: str, right: tuple[str, int]) -> tuple[str, int]:
    """(expression, precedence) of `left op right`, with only the parentheses it needs."""
    p = _PRECEDENCE[op]
    a = f"({left[0]})" if left[1] < p else left[0]
    b = f"({right[0]})" if right[1] < p or (right[1] == p and op in "-/") else right[0]
    return f"{a}{op}{b}", p


def random_question(rng: random.Random) -> Question:
    """Numbers, then a random expression over two or more of them whose steps stay whole and
    positive (as a learner would work it) and whose value, new among the numbers, is the target."""
    while True:
        numbers = [rng.randint(1, MAX_NUMBER) for _ in range(rng.randint(MIN_NUMBERS, MAX_NUMBERS))]
        items = [(n, (str(n), 3)) for n in rng.sample(numbers, rng.randint(2, len(numbers)))]
        while len(items) > 1:
            (a, left), (b, right) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            ops = ["+", "*"] + ["-"] * (a > b) + ["/"] * (b > 1 and a % b == 0)
            op = rng.choice(ops)
            items.append(({"+": a + b, "-": a - b, "*": a * b, "/": a // max(b, 1)}[op], _join(left, op, right)))
        (value, (solution, _)), = items
        if 1 <= value <= MAX_TARGET and value not in numbers:
            return Question(tuple(numbers), value, solution)


def sample_questions(n: int, seed: int, split: str, heldout_percent: int, validation_percent: int = 0) -> list[Question]:
    """`n` distinct questions of `split` ("train", "heldout" or "validation"), reproducible from `seed`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{seed}-countdown-{split}")
    seen: dict[str, Question] = {}
    for _ in range(200 * n + 1000):
        q = random_question(rng)
        if split_of(q.key, heldout_percent / 100, validation_percent / 100) == split:
            seen.setdefault(q.key, q)
            if len(seen) == n:
                return list(seen.values())
    raise TooFewQuestions(f"could not draw {n} distinct countdown {split} questions (found {len(seen)})", len(seen))


def make_rows(questions: list[Question]) -> list[dict]:
    """Dataset rows: the prompt, the numbers and target the rule grades by, the target as the
    reference answer, and the demonstration."""
    return [{"prompt": format_prompt(q.numbers, q.target), "question": f"{' '.join(map(str, q.numbers))} -> {q.target}",
             "numbers": list(q.numbers), "target": q.target, "answer": str(q.target), "solution": f"A: {q.solution}"}
            for q in questions]


def evaluate(expression: str) -> tuple[Fraction, Counter] | None:
    """The exact value of an arithmetic expression and how often it uses each number; None when it
    is anything else (a name, a call, a power, a decimal point, a unary minus) or divides by zero."""
    text = expression.strip()
    if len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used: Counter = Counter()

    def value(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        digits = ast.get_source_segment(text, node) or ""
        if isinstance(node, ast.Constant) and type(node.value) is int and digits.isascii() and digits.isdigit():
            used[node.value] += 1  # written in plain digits: 0x19 or 2_5 is no given number
            return Fraction(node.value)
        raise ValueError(f"not allowed in an answer: {type(node).__name__}")

    try:
        return value(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def is_solution(expression: str, numbers, target: int) -> bool:
    """Whether `expression` equals `target`, using only the given `numbers`, each at most as
    often as it is given."""
    result = evaluate(expression)
    return result is not None and result[0] == target and not result[1] - Counter(numbers)


def extract_answer(completion: str) -> str | None:
    """The answer line's expression; None if absent or if several lines disagree."""
    answers = {a.strip() for a in _ANSWER.findall(completion)} - {""}
    return answers.pop() if len(answers) == 1 else None


def grade(rows: list[dict], completions: list[str]) -> list[bool]:
    return [(e := extract_answer(c)) is not None and is_solution(e, r["numbers"], int(r["target"]))
            for r, c in zip(rows, completions)]


def countdown_accuracy(prompts: list[str], completions: list[str], numbers: list, target: list, **_) -> list[float]:
    """Rule-based outcome reward: 1.0 when the answer reaches the target with the given numbers, else 0.0."""
    rows = [{"numbers": n, "target": t} for n, t in zip(numbers, target)]
    return [float(ok) for ok in grade(rows, completions)]


@register_task("countdown")
class CountdownTask:
    reward = "grpokit.tasks.countdown:countdown_accuracy"  # by import path: no new built-in reward name
    step_labeller = None  # one answer line: no steps to label
    hard_negative = None
    extract_answer = staticmethod(extract_answer)
    grade = staticmethod(grade)

    def __init__(self, config: Config):
        self.config, self.seed = config.task, config.seed

    def data(self, tokenizer=None, sft: bool = True) -> TaskData:
        """SFT demonstrations, RL questions and held-out questions, all from seeds (as ChainTask's:
        the held-out ones from seed 0 whatever the run's seed). It reads the task section's
        num_sft_examples, num_rl_questions, num_eval_questions, num_validation_questions, heldout_percent
        and validation_percent."""
        t, seed = self.config, self.seed
        _check_tokenizer(tokenizer)
        shares = (t.heldout_percent, t.validation_percent)
        demos = make_rows(sample_questions(t.num_sft_examples, seed, "train", *shares)) if sft else []
        rl = make_rows(sample_questions(t.num_rl_questions, seed + 1, "train", *shares))
        heldout = make_rows(sample_questions(t.num_eval_questions, 0, "heldout", *shares))
        validation = make_rows(validation_questions(lambda n: sample_questions(n, 0, "validation", *shares), t))
        return TaskData([{"prompt": r["prompt"], "completion": r["solution"]} for r in demos],
                        [{k: r[k] for k in ("prompt", "numbers", "target", "answer")} for r in rl], heldout,
                        validation)

    def prompt(self, row: dict, mode: str, tokenizer) -> str | None:
        """The numbers and the target (cot); None for tir: the task has no tool-integrated form."""
        return format_prompt(row["numbers"], int(row["target"])) if mode == "cot" else None

    def tir_rows(self, rows: list[dict], tokenizer) -> None:
        """No tool-integrated form: a program would only search the expressions for the model."""
        return None

    def tir_answer(self, completion: str) -> None:
        return None

    def report(self, result) -> dict[str, float]:
        """How many greedy answers are expressions the rule can compute, right or wrong: the format
        learnt apart from the arithmetic."""
        formed = [c for c in result.greedy_completions if (e := extract_answer(c)) is not None and evaluate(e)]
        return {"valid syntax": len(formed) / max(1, len(result.greedy_completions))}


def _check_tokenizer(tokenizer) -> None:
    """A character tokenizer without the prompt's letters or * and / would read them as <unk>."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in tokenizer(format_prompt([1, 2], 3) + "A: (1+2)*3/4-5",
                                            add_special_tokens=False)["input_ids"]:
        raise ConfigError("task.name=countdown: the tokenizer cannot spell the task's letters, * and /: use "
                          "model.tiny.alphabet=ascii (or a model whose tokenizer can)")
