"""`gsm8k_steps`: a step checker for GSM8K-style solutions with calculator annotations.

GSM8K's solutions write each computation as `<<expression=result>>` followed by the result:

    Natalia sold 48/2 = <<48/2=24>>24 clips in May.
    Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.
    #### 72

Steps are the completion's lines (split as a process reward model splits them: rewards/process.py,
line_steps). A step is right when

  - every annotation on it is exact: its expression (numbers, + - * / and parentheses) equals the
    stated result as an exact fraction, so 10/3=3.33 is wrong; an annotation that does not parse is wrong;
  - it is the answer step (the first line holding "#### x") and x equals the reference answer
    (numbers compared exactly, commas, $ and a trailing full stop ignored);
  - it is any other line before the answer step (text without annotations is not checked).

The last step must state the reference: a completion without a "####" line has its last step wrong,
and every line after the answer step is wrong. As for the chain task (arithmetic.step_labels), a
step scores 1.0 when it and every step before it are right, else 0.0 (the first error and all after it).
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from grpokit.data.answers import clean_answer, gsm8k_reference
from grpokit.rewards.process import StepScores, line_steps, process_reward, step_char_ends

_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b}
_MAX_DIGITS = 60  # longer numbers are no calculator's; refusing them keeps evaluation bounded


def number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,200", "$5", ".5", "3/4", "-2." ), or None."""
    cleaned = clean_answer(text).replace(",", "").replace("$", "").rstrip(".").strip()
    if not cleaned or len(cleaned) > _MAX_DIGITS:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def evaluate(expression: str) -> Fraction | None:
    """An annotation's arithmetic, exactly; None when it is not numbers joined by + - * / and parentheses."""
    text = expression.replace(",", "").replace("$", "").strip()
    if not text or len(text) > 200:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not arithmetic")

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError):
        return None


def annotation_is_exact(annotation: str) -> bool:
    """"48/2=24" -> True; "10/3=3.33" -> False: the expression before the last "=" equals the result after it."""
    expression, equals, result = annotation.rpartition("=")
    if not equals:
        return False
    left, right = evaluate(expression), number(result)
    return left is not None and right is not None and left == right


def same_answer(stated: str, reference: str) -> bool:
    a, b = number(stated), number(reference)
    if a is not None and b is not None:
        return a == b
    return clean_answer(stated) == clean_answer(reference) != ""


def step_verdicts(steps: list[str], reference: str) -> list[bool]:
    """Each step's own verdict (before the first-error rule): annotations exact, the answer step's answer right."""
    verdicts, answered = [], False
    for step in steps:
        ok = not answered and all(annotation_is_exact(a) for a in _ANNOTATION.findall(step))
        stated = _ANSWER.search(step)
        if stated is not None and not answered:
            ok = ok and same_answer(stated.group(1), reference)
            answered = True
        verdicts.append(ok)
    if not answered and verdicts:
        verdicts[-1] = False  # the last step must state the reference answer
    return verdicts


def reference_answer(answer: str) -> str:
    """A row's reference: the bare answer, or GSM8K's full answer field ("... #### 72") read after its ####."""
    return gsm8k_reference(answer) if "####" in answer else answer.strip()


@process_reward
def gsm8k_steps(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[StepScores]:
    """One StepScores per completion: 1.0 for each step of the right prefix, 0.0 from the first wrong step on."""
    out = []
    for completion, reference in zip(completions, answer):
        steps, has_delimiter = line_steps(completion)
        right_so_far, scores = True, []
        for ok in step_verdicts(steps, reference_answer(str(reference))):
            right_so_far = right_so_far and ok
            scores.append(float(right_so_far))
        out.append(StepScores(scores, step_char_ends(steps), has_delimiter))
    return out
