"""Tool-integrated reasoning: prompts, program extraction, output blocks, answers, and
rollouts driven by a scripted generate_fn whose programs run in the real sandbox."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpokit.eval.tir import (
    COT_INSTRUCTION,
    OUTPUT_STOP,
    TIR_INSTRUCTION,
    build_prompt,
    cumulative_program,
    final_answer,
    format_tool_output,
    last_python_block,
    plain_chat,
    python_blocks,
    shorten,
    tir_rollout,
)
from grpokit.sandbox import SandboxResult, run_many


def result(stdout="", error=None, timed_out=False) -> SandboxResult:
    return SandboxResult(stdout=stdout, error=error, timed_out=timed_out, isolated=True)


# --- prompts -------------------------------------------------------------------------------


def test_prompts_match_deepseekmath():
    assert build_prompt("What is 1+1?", "cot") == (
        "What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert build_prompt("What is 1+1?", "tir") == (
        "What is 1+1?\nPlease integrate natural language reasoning with programs to solve the problem above, "
        "and put your final answer within \\boxed{}."
    )
    assert COT_INSTRUCTION.endswith("within \\boxed{}.") and TIR_INSTRUCTION.startswith("Please integrate")
    assert plain_chat("Q?\nInstruction.") == "User: Q?\nInstruction.\n\nAssistant:"
    assert plain_chat("  Q?\n") == "User: Q?\n\nAssistant:"
    with pytest.raises(ValueError, match="'pot'"):
        build_prompt("Q", "pot")


# --- programs ------------------------------------------------------------------------------

TWO_BLOCKS = (
    "First.\n```python\nx = 3\nprint(x)\ndef f(y):\n    print(y)\n    return y + 1\nimport math\n```\n"
    "```output\n3\n```\nThen.\n```python\nprint(f(x))\n```\n```output"
)


def test_python_blocks_and_last_block():
    assert python_blocks(TWO_BLOCKS) == [
        "x = 3\nprint(x)\ndef f(y):\n    print(y)\n    return y + 1\nimport math",
        "print(f(x))",
    ]
    assert last_python_block(TWO_BLOCKS) == "print(f(x))"
    assert last_python_block("```python\nprint(1)\n```\n```python\nprint(2)") == "print(1)"  # unclosed block
    assert last_python_block("no code\n```output") is None
    assert python_blocks("```python\n\n```") == []


def test_cumulative_program_follows_deepseek_rule():
    # Earlier blocks lose top-level print lines; indented, import and def lines stay.
    assert cumulative_program(TWO_BLOCKS) == (
        "x = 3\ndef f(y):\n    print(y)\n    return y + 1\nimport math\nprint(f(x))"
    )
    assert cumulative_program("```python\nprint(1)\n```\n```output\n") == "print(1)"
    # The fence must close right before "```output".
    assert cumulative_program("```python\nprint(1)\n```\nand then\n```output") is None
    assert cumulative_program("no code```\n```output") is None


# --- output blocks -------------------------------------------------------------------------


def test_format_tool_output_layout():
    assert format_tool_output(result("1024\n")) == "```output\n1024\n```\n"
    assert format_tool_output(result("")) == "```output\n\n```\n"
    assert format_tool_output(result("  a\nb  \n")) == "```output\na\nb\n```\n"


def test_long_output_keeps_first_and_last_fifty_characters():
    text = "".join(chr(ord("a") + i % 26) for i in range(150))
    assert shorten(text) == text[:50] + "..." + text[100:]
    assert format_tool_output(result(text)) == f"```output\n{text[:50]}...{text[100:]}\n```\n"
    exactly_100 = "x" * 100
    assert format_tool_output(result(exactly_100)) == f"```output\n{exactly_100}\n```\n"


@given(st.text(max_size=300))
def test_shorten_keeps_both_ends(text):
    short = shorten(text)
    assert short == text if len(text) <= 100 else (short == text[:50] + "..." + text[-50:] and len(short) == 103)


def test_errors_and_timeouts_replace_the_output():
    failed = result("partial\n", error="ZeroDivisionError: division by zero")
    assert format_tool_output(failed) == "```output\nZeroDivisionError: division by zero\n```\n"
    late = result("partial\n", error="TimeoutError: the program ran past its 10 s deadline", timed_out=True)
    assert format_tool_output(late) == "```output\nTimeout Error\n```\n"


# --- answers -------------------------------------------------------------------------------


def test_final_answer():
    assert final_answer("so $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert final_answer("\\boxed{1} then \\boxed{ 2 }") == "2"
    assert final_answer("```output\n41\n```\nwell\n```output\n42\n```\n") == "42"
    assert final_answer("```output\n41\n```\n\\boxed{7}") == "7"
    assert final_answer("\\boxed{}\n```output\n5\n```\n") == "5"
    assert final_answer("```output\n\n```\n") is None
    assert final_answer("no answer") is None


# --- rollouts ------------------------------------------------------------------------------


class Script:
    """generate_fn that answers each prompt with its scripted continuations, in order, and
    records the contexts it was given."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {p: list(c) for p, c in script.items()}
        self.calls: list[list[str]] = []

    def __call__(self, contexts):
        self.calls.append(list(contexts))
        out = []
        for context in contexts:
            prompt = next(p for p in self.script if context.startswith(p))
            out.append(self.script[prompt].pop(0))
        return out


def test_rollout_golden():
    p1, p2 = plain_chat(build_prompt("2^10?", "tir")), plain_chat(build_prompt("3+4?", "tir"))
    step1 = " Let me compute.\n```python\nprint(2**10)\n```\n```output"
    step2 = "\nSo the answer is $\\boxed{1024}$."
    script = Script({p1: [step1, step2], p2: [" It is $\\boxed{7}$."]})
    batches = []

    def run_fn(codes):
        batches.append(list(codes))
        return run_many(codes)

    t1, t2 = tir_rollout(script, [p1, p2], run_fn=run_fn)

    assert t1.completion == step1 + "\n1024\n```\n" + step2
    assert t1.tool_spans == [(len(step1), len(step1) + len("\n1024\n```\n"))]
    assert t1.completion[slice(*t1.tool_spans[0])] == "\n1024\n```\n"
    assert (t1.tool_calls, t1.stop_reason, t1.answer) == (1, "answer", "1024")
    assert t1.tool_results[0].stdout == "1024\n"
    assert (t2.completion, t2.tool_spans, t2.tool_calls, t2.stop_reason, t2.answer) == (
        " It is $\\boxed{7}$.", [], 0, "answer", "7")
    # Round 2 continues only the prompt that called a tool, from prompt + completion so far.
    assert script.calls == [[p1, p2], [p1 + step1 + "\n1024\n```\n"]]
    assert batches == [["print(2**10)"]]


def test_rollout_stops_at_the_tool_call_limit_and_carries_variables():
    code1 = "```python\nx = 6 * 7\nprint(x)\n```\n```output"
    code2 = "\n```python\nprint(x + 1)\n```\n```output"
    script = Script({"Q": [code1, code2, "never used"]})
    (trace,) = tir_rollout(script, ["Q"], max_tool_calls=2)
    assert trace.completion == code1 + "\n42\n```\n" + code2 + "\n43\n```\n"
    assert (trace.tool_calls, trace.stop_reason, trace.answer) == (2, "tool_limit", "43")
    assert [trace.completion[a:b] for a, b in trace.tool_spans] == ["\n42\n```\n", "\n43\n```\n"]
    assert len(script.calls) == 2

    # Each block on its own (ToRA's way): the second block no longer sees x.
    script = Script({"Q": [code1, code2]})
    (alone,) = tir_rollout(script, ["Q"], max_tool_calls=2, program_fn=last_python_block)
    assert alone.completion.endswith("```output\nNameError: name 'x' is not defined\n```\n")


def test_rollout_failing_and_slow_programs():
    crash = "```python\nprint('partial')\n1 / 0\n```\n```output"
    slow = "```python\nwhile True:\n    pass\n```\n```output"
    script = Script({"A": [crash, " \\boxed{0}"], "B": [slow, " \\boxed{1}"]})
    # 3 s: the failing program must start and crash well within it even on a busy machine.
    a, b = tir_rollout(script, ["A", "B"], run_fn=lambda codes: run_many(codes, timeout_s=3.0))
    assert a.completion == crash + "\nZeroDivisionError: division by zero\n```\n \\boxed{0}", a.tool_results
    assert b.completion == slow + "\nTimeout Error\n```\n \\boxed{1}"
    assert b.tool_results[0].timed_out


def test_rollout_handles_overhang_and_missing_program():
    # A tokenizer's last token may carry the newline after "```output": it is kept, not doubled.
    overhang = "```python\nprint(5)\n```\n```output\n"
    no_code = "I will now show the output\n```output"
    script = Script({"A": [overhang, "done"], "B": [no_code]})
    a, b = tir_rollout(script, ["A", "B"])
    assert a.completion == overhang + "5\n```\ndone"
    assert a.completion[slice(*a.tool_spans[0])] == "5\n```\n"
    assert (b.completion, b.tool_calls, b.stop_reason, b.tool_spans) == (no_code, 0, "no_program", [])
    # "```output" inside the text but not at the end is not a stop.
    script = Script({"C": [f"the marker {OUTPUT_STOP} appears mid-text"]})
    assert tir_rollout(script, ["C"])[0].stop_reason == "answer"


def test_rollout_checks_its_inputs():
    with pytest.raises(ValueError, match="returned 0 continuations for 1 contexts"):
        tir_rollout(lambda contexts: [], ["Q"])
    with pytest.raises(ValueError, match="max_tool_calls"):
        tir_rollout(lambda contexts: contexts, ["Q"], max_tool_calls=0)
    assert tir_rollout(lambda contexts: [], []) == []
