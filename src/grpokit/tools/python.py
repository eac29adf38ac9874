"""The Python tool of tool-integrated reasoning (TIR), as DeepSeekMath evaluates it (paper,
Table 5): the policy writes a ```python block, then "```output"; the program runs in the
sandbox (grpokit.tools.sandbox) and its output block is appended:

    We need 2 to the 10th power.
    ```python
    print(2**10)
    ```
    ```output
    1024
    ```
    So the answer is $\\boxed{1024}$.

Following DeepSeekMath's evaluation code, a program is the latest block together with the
earlier blocks of the same completion minus their top-level print lines (variables carry
over, old prints stay quiet); an output longer than 100 characters shows its first and last
50; a failed program shows the last line of its traceback; a program past its deadline
shows "Timeout Error".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from grpokit.data.templates import TIR_INSTRUCTION
from grpokit.tools.sandbox import SandboxResult, run_many
from grpokit.tools.registry import ToolOutput, register_tool

OUTPUT_STOP = "```output"
# DeepSeekMath shows at most 100 characters of a program's output: the first and last 50.
MAX_OUTPUT_CHARS = 100
TIMEOUT_OUTPUT = "Timeout Error"

_PYTHON_BLOCK = re.compile(r"```python(.*?)```", re.DOTALL)


def _before_stop(text: str) -> str:
    """`text` without a trailing "```output" (and whitespace after it)."""
    stripped = text.rstrip()
    return stripped[: -len(OUTPUT_STOP)] if stripped.endswith(OUTPUT_STOP) else text


def python_blocks(text: str) -> list[str]:
    """The closed ```python blocks of `text`, stripped, empty ones left out, in order."""
    return [b for b in (m.group(1).strip() for m in _PYTHON_BLOCK.finditer(text)) if b]


def last_python_block(text: str) -> str | None:
    """The last closed ```python block before a trailing "```output"; None when there is none.
    As a rollout's `program_fn`, each block runs on its own (ToRA's choice)."""
    blocks = python_blocks(_before_stop(text))
    return blocks[-1] if blocks else None


def cumulative_program(text: str) -> str | None:
    """The program DeepSeekMath's evaluation runs for a completion that stopped at "```output".

    The completion must end with a closing fence right before "```output". The program is
    every earlier block's lines except top-level lines containing "print(" (lines that are
    indented or start with "import" or "def " always stay), then the last block whole.
    None when there is nothing to run.
    """
    text = _before_stop(text)
    if not text.rstrip().endswith("```"):
        return None
    blocks = python_blocks(text)
    if not blocks:
        return None
    kept = [
        line
        for block in blocks[:-1]
        for line in block.split("\n")
        if line.startswith(("    ", "import", "def ")) or "print(" not in line
    ]
    return "\n".join([*kept, blocks[-1]]).strip()


def shorten(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """`text` when at most `limit` characters, else its first and last limit/2 around "..."."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + "..." + text[-half:]


def format_tool_output(result: SandboxResult) -> str:
    """The output block the model sees: "```output\\n{shown}\\n```\\n".

    shown is "Timeout Error" for a timeout, the last traceback line for a failure (what the
    program printed before failing is dropped), else stdout; stripped and cut to 100 characters.
    """
    if result.timed_out:
        shown = TIMEOUT_OUTPUT
    elif result.error is not None:
        shown = result.error
    else:
        shown = result.stdout
    return f"{OUTPUT_STOP}\n{shorten(shown.strip()).strip()}\n```\n"


def output_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) after each "```output" up to and including the next "```" and the newline
    after it (or the text's end): the output blocks, as tool_output appends them."""
    spans, at = [], text.find(OUTPUT_STOP)
    while at >= 0:
        start = at + len(OUTPUT_STOP)
        close = text.find("```", start)
        end = len(text) if close < 0 else close + 3 + text.startswith("\n", close + 3)
        spans.append((start, end))
        at = text.find(OUTPUT_STOP, end)
    return spans


def tool_output(result: SandboxResult) -> ToolOutput:
    """A program's result as the text appended after "```output" (its output block's rest)."""
    return ToolOutput(format_tool_output(result)[len(OUTPUT_STOP) :], failed=result.error is not None,
                      timed_out=result.timed_out, seconds=result.seconds)


PROGRAMS = {"cumulative": cumulative_program, "last_block": last_python_block}


@register_tool("python")
@dataclass
class PythonTool:
    """Runs the completion's program in the sandbox, each in a fresh process, up to `workers`
    at a time. program: "cumulative" (DeepSeekMath's evaluation) or "last_block" (ToRA: each
    block on its own)."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    workers: int | None = None
    program: str = "cumulative"

    name: ClassVar[str] = "python"
    stop: ClassVar[str] = OUTPUT_STOP
    instruction: ClassVar[str] = TIR_INSTRUCTION
    texts: ClassVar[tuple[str, ...]] = ("```python\n", "```\n")  # a program's fences

    def __post_init__(self) -> None:
        if self.program not in PROGRAMS:
            raise ValueError(f"the python tool's program must be one of {sorted(PROGRAMS)}, got {self.program!r}")

    def parse(self, completion: str) -> str | None:
        return PROGRAMS[self.program](completion)

    def output_spans(self, text: str) -> list[tuple[int, int]]:
        """[start, end) of each output block's text after "```output" in a demonstration, through the
        closing fence's newline: what the tool, not the policy, writes in a rollout."""
        return output_spans(text)

    def run(self, calls: Sequence[str]) -> list[ToolOutput]:
        results = run_many(list(calls), timeout_s=self.timeout_s, memory_mb=self.memory_mb, workers=self.workers)
        return [tool_output(r) for r in results]
