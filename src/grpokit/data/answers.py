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

Reference solutions (math_reference) are LaTeX, and their boxes are read as LaTeX reads them:
"\\boxed 2" is 2 there (reference_boxes).
"""

from __future__ import annotations

import re

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Reference solutions are LaTeX, so their boxes are read as LaTeX reads a macro's argument.
_BOX_NAME = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_CONTROL_SEQUENCE = re.compile(r"\\(?:[A-Za-z]+|.)", re.DOTALL)
# One-token box arguments LaTeX cannot typeset: TeX's special characters, and commands that
# need arguments of their own (the box would hold the bare command).
_SPECIAL_CHARACTERS = {"}", "$", "%", "&", "#", "^", "_", "\\\\"}
_NEEDS_ARGUMENTS = {"frac", "dfrac", "tfrac", "cfrac", "sqrt", "binom", "dbinom", "tbinom", "text", "textbf",
                    "mathrm", "mathbf", "mathbb", "operatorname", "overline", "boxed", "fbox", "left", "right",
                    "begin", "end"}
# What may follow a one-token box whose token is the whole answer: the end of the math or of
# the sentence. Anything else ("\\boxed 12", "\\boxed x+1") is more answer than LaTeX boxes.
_MATH_ENDS = re.compile(r"\s*(?:$|\$|\\\]|\\\)|\\end\b|[.,;](?:\s|\$|$))")
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
        raise ValueError(f"the GSM8K answer has no '#### <number>' line ({answer_text[-80:]!r}): end it with one")
    return found[-1].strip().replace(",", "")


def _box_argument(text: str, at: int, closes: dict[int, int]) -> tuple[str | None, int]:
    """(the box's argument, where it ends) read from `at`, just after "\\boxed" and its spaces,
    as TeX reads a macro's one argument: a {group} gives its contents; anything else gives the
    one next token, a character ("\\boxed 2" is 2) or a control sequence ("\\boxed\\pi").
    None where that is not the answer the author wrote: braces that never close, nothing left,
    a token that cannot stand alone ("\\boxed \\frac12" boxes \\frac by itself, "\\boxed $" a
    math shift), or more of the answer right after the token ("\\boxed 12" boxes only the 1)."""
    if at >= len(text):
        return None, at
    if text[at] == "{":
        end = closes.get(at)
        return (None, at) if end is None else (text[at + 1 : end], end + 1)
    token = _CONTROL_SEQUENCE.match(text, at)
    end = token.end() if token else at + 1
    argument = text[at:end]
    is_bare_command = argument.startswith("\\") and argument[1:] in _NEEDS_ARGUMENTS
    cut_short = not _MATH_ENDS.match(text, end)
    return (None if is_bare_command or cut_short or argument in _SPECIAL_CHARACTERS else argument), end


def reference_boxes(text: str) -> list[str | None]:
    """The argument of each outermost \\boxed / \\fbox of a reference solution, in order, read as
    LaTeX reads it (_box_argument); None for a box LaTeX could not typeset."""
    starts = list(_BOX_NAME.finditer(text))
    closes = _match_braces(text, [m.end() for m in starts if text[m.end() : m.end() + 1] == "{"])
    out, covered_until = [], -1
    for m in starts:
        if m.start() < covered_until:  # inside an earlier box's argument
            continue
        argument, covered_until = _box_argument(text, m.end(), closes)
        out.append(argument)
    return out


def math_reference(solution: str, answer: str | None = None) -> str:
    """The reference answer of a MATH row: its `answer` field when given, else the argument of
    the last box of its solution, read as LaTeX does (reference_boxes)."""
    if answer is not None and answer.strip():
        return answer.strip()
    boxes = reference_boxes(solution)
    if not boxes:
        raise ValueError(f"the MATH solution has no \\boxed{{...}} answer ({solution[-80:]!r}): box the final "
                         "answer, or give the row an 'answer' field")
    last = boxes[-1]
    if last is None or not last.strip():
        problem = "cannot be read as an answer" if last is None else "is empty"
        raise ValueError(f"the MATH solution's last box {problem} ({solution[-80:]!r}): write it as "
                         "\\boxed{<answer>}, or give the row an 'answer' field")
    return last.strip()


_OUTPUT_BLOCK = re.compile(r"```output\n(.*?)\n```", re.DOTALL)


def final_answer(text: str) -> str | None:
    """The content of the last non-empty \\boxed{} (nested braces matched), else the content
    of the last ```output block (a rollout cut at its tool-call limit ends on one), else None."""
    boxes = [b.strip() for b in boxed_contents(text) if b.strip()]
    return boxes[-1] if boxes else last_output(text)


def last_output(text: str) -> str | None:
    """The content of the last ```output block, stripped; None when there is none or it is empty."""
    outputs = [o.strip() for o in _OUTPUT_BLOCK.findall(text)]
    return outputs[-1] if outputs and outputs[-1] else None
