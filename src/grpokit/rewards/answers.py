"""Final answers as text: find them in completions and reference solutions.

Pure string functions (no math-verify, no sympy), linear in the input length and free of
recursion, so a 100 kB completion or a million nested braces costs milliseconds.

A completion states its final answer in one of four formats, tried strongest first:

    \\boxed{...} or \\fbox{...}   (braces matched; only outermost boxes count)
    #### 42                      (GSM8K)
    The answer is 42.
    A: 42                        (a line of its own)

Only the first format that appears counts. When it appears several times with different
contents, the completion has no single final answer: stuffing candidates never pays.
"""

from __future__ import annotations

import re

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"(?i)\bthe\s+(?:final\s+)?answer\s+is\b[ \t:]*([^\n]*)")
_A_LINE = re.compile(r"^[ \t]*A:[ \t]*([^\n]*)$", re.MULTILINE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
# Whitespace next to a brace means nothing in math mode ("\\ {" excepted: a control space).
_BRACE_SPACE = re.compile(r"(?<=[{}])\s+|(?<!\\)\s+(?=[{}])")
_PLAIN_UNITS = re.compile(r"^(-?(?:\d[\d,]*)?\.?\d+)\s+([A-Za-z][A-Za-z' \-]*)$")
# Words that scale a number: "1.8 billion" is not 1.8, so such answers keep their words.
_MAGNITUDES = {"hundred", "thousand", "million", "billion", "trillion", "dozen"}


def _match_braces(text: str, opens: list[int]) -> dict[int, int]:
    """{index of "{": index of its matching "}"} for each index in `opens` that closes.

    One pass with an explicit stack. A backslash escapes the next character, so the
    literal braces \\{ and \\} never count.
    """
    wanted, matched, stack = set(opens), {}, []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            start = stack.pop()
            if start in wanted:
                matched[start] = i
        i += 1
    return matched


def boxed_contents(text: str) -> list[str]:
    """Contents of the outermost \\boxed{...}/\\fbox{...} groups, in order; a box whose
    braces never close is skipped."""
    opens = [m.end() - 1 for m in _BOX_START.finditer(text)]
    if not opens:
        return []
    closes = _match_braces(text, opens)
    out, covered_until = [], -1
    for start in opens:
        end = closes.get(start)
        if end is None or start < covered_until:  # unbalanced, or nested in an earlier box
            continue
        out.append(text[start + 1 : end])
        covered_until = end
    return out


def clean_answer(answer: str) -> str:
    """Surface cleanup that never changes a value: collapse whitespace (dropping it next to
    braces, where math-verify's extraction stumbles on it), drop $ delimiters and
    currency signs, markdown bold, a trailing full stop, and plain-text units after a number
    ("18 dollars" -> "18", but "1.8 billion" stays)."""
    text = _BRACE_SPACE.sub("", " ".join(answer.split()))
    text = text.replace("\\$", "").replace("$", "").replace("**", "")
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)]
    text = text.strip().rstrip(".;,").strip()
    m = _PLAIN_UNITS.match(text) if len(text) <= 100 else None  # bounded: the regex backtracks
    if m and m.group(2).split()[0].lower() not in _MAGNITUDES:
        text = m.group(1)
    return text


def _answer_is(text: str) -> list[str]:
    out = []
    for m in _ANSWER_IS.finditer(text):
        rest = m.group(1)
        end = _SENTENCE_END.search(rest)
        out.append(rest[: end.start()] if end else rest)
    return out


_FORMATS = (boxed_contents, _HASHES.findall, _answer_is, _A_LINE.findall)


def _stated(completion: str) -> list[str]:
    """Every (cleaned, non-empty) answer of the strongest format present, repeats included."""
    for find in _FORMATS:
        answers = [a for a in map(clean_answer, find(completion)) if a]
        if answers:
            return answers
    return []


def final_answers(completion: str) -> list[str]:
    """The distinct final answers the completion states, cleaned, in order of appearance,
    from the strongest format present. [] when it states none."""
    return list(dict.fromkeys(_stated(completion)))


def answer_count(completion: str) -> int:
    """How many times the completion states a final answer (repeats included)."""
    return len(_stated(completion))


def extract_final_answer(completion: str) -> str | None:
    """The completion's single final answer; None when it states none or several different."""
    answers = final_answers(completion)
    return answers[0] if len(answers) == 1 else None


def gsm8k_reference(answer_text: str) -> str:
    """The reference number of a GSM8K `answer` field: what follows the last "####", commas removed."""
    found = _HASHES.findall(answer_text)
    if not found or not found[-1].strip():
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_text[-80:]!r}")
    return found[-1].strip().replace(",", "")


def math_reference(solution: str, answer: str | None = None) -> str:
    """The reference answer of a MATH row: its `answer` field when given, else the last
    boxed expression of its solution."""
    if answer is not None and answer.strip():
        return answer.strip()
    boxes = boxed_contents(solution)
    if not boxes:
        raise ValueError(f"MATH solution has no \\boxed{{...}} answer: {solution[-80:]!r}")
    return boxes[-1].strip()
