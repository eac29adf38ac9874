"""Tool-integrated reasoning: prompts, program extraction, output blocks, answers, and
evaluation's rollouts (the multi-turn rollout RL trains on) driven by a scripted engine whose
programs run in the real sandbox."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpokit.eval.tir import (
    COT_INSTRUCTION,
    TIR_INSTRUCTION,
    build_prompt,
    final_answer,
    plain_chat,
    RolloutLimits,
    Timings,
    rollouts,
)
from grpokit.tools.python import OUTPUT_STOP, cumulative_program, format_tool_output, last_python_block, python_blocks, shorten
from grpokit.models import build_char_tokenizer
from grpokit.pipeline.build import ASCII_ALPHABET
from grpokit.rollout import Continuation, SamplingParams
from grpokit.tools.sandbox import SandboxResult
from grpokit.tools.python import PythonTool


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
    """An engine whose continuation of each context is the next scripted string of the prompt it
    starts with, tokenised one character per token; "stop" when it ends at a stop string. It
    records the decoded contexts of each call."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {p: list(c) for p, c in script.items()}
        self.calls: list[list[str]] = []
        self.tokenizer = TOKENIZER

    def continue_ids(self, contexts, budgets, params, seeds=None):
        texts = [self.tokenizer.decode(ids) for ids in contexts]
        self.calls.append(texts)
        out = []
        for text, budget in zip(texts, budgets, strict=True):
            reply = self.script[next(p for p in self.script if text.startswith(p))].pop(0)
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            stopped = any(reply.rstrip("\n").endswith(stop) for stop in params.stop)
            out.append(Continuation(ids[:budget], "length" if len(ids) > budget else "stop" if stopped else "eos"))
        return out


TOKENIZER = build_char_tokenizer(ASCII_ALPHABET)


def tir(script, prompts, max_tool_calls=4, max_new_tokens=200, tool=None):
    """Greedy TIR rollouts of `prompts` on `script`: the traces, their stop reasons and timings."""
    timings = Timings()
    out = rollouts(script, TOKENIZER, prompts, "tir", SamplingParams(max_new_tokens, 0.0, stop=(OUTPUT_STOP,)),
                   RolloutLimits(10_000, 0, max_tool_calls, tool), timings)
    return [trace for trace, _ in out], [reason for _, reason in out], timings


def test_rollout_golden():
    p1, p2 = plain_chat(build_prompt("2^10?", "tir")), plain_chat(build_prompt("3+4?", "tir"))
    step1 = " Let me compute.\n```python\nprint(2**10)\n```\n```output"
    step2 = "\nSo the answer is $\\boxed{1024}$."
    script = Script({p1: [step1, step2], p2: [" It is $\\boxed{7}$."]})

    (t1, t2), reasons, timings = tir(script, [p1, p2])

    assert t1.completion == step1 + "\n1024\n```\n" + step2
    assert (t1.tool_calls, t1.answer) == (1, "1024") and t1.tool_outputs[0].text == "\n1024\n```\n"
    assert (t2.completion, t2.tool_calls, t2.answer) == (" It is $\\boxed{7}$.", 0, "7")
    assert reasons == ["answer", "answer"]
    # Round 2 continues only the prompt that called a tool, from prompt + completion so far.
    assert script.calls == [[p1, p2], [p1 + step1 + "\n1024\n```\n"]]
    assert (timings.programs, timings.generate_calls) == (1, 2) and timings.tools > 0 and timings.generate > 0


def test_rollout_stops_at_the_tool_call_limit_and_carries_variables():
    code1 = "```python\nx = 6 * 7\nprint(x)\n```\n```output"
    code2 = "\n```python\nprint(x + 1)\n```\n```output"
    script = Script({"Q": [code1, code2, "never used"]})
    (trace,), reasons, _ = tir(script, ["Q"], max_tool_calls=2)
    assert trace.completion == code1 + "\n42\n```\n" + code2 + "\n43\n```\n"
    assert (trace.tool_calls, reasons, trace.answer) == (2, ["tool_limit"], "43")
    assert [o.text for o in trace.tool_outputs] == ["\n42\n```\n", "\n43\n```\n"]
    assert len(script.calls) == 2

    # Each block on its own (ToRA's way): the second block no longer sees x.
    script = Script({"Q": [code1, code2]})
    (alone,), _, _ = tir(script, ["Q"], max_tool_calls=2, tool=PythonTool(program="last_block"))
    assert alone.completion.endswith("```output\nNameError: name 'x' is not defined\n```\n")


def test_rollout_failing_and_slow_programs():
    crash = "```python\nprint('partial')\n1 / 0\n```\n```output"
    slow = "```python\nwhile True:\n    pass\n```\n```output"
    script = Script({"A": [crash, " \\boxed{0}"], "B": [slow, " \\boxed{1}"]})
    # 3 s: the failing program must start and crash well within it even on a busy machine.
    (a, b), _, _ = tir(script, ["A", "B"], tool=PythonTool(timeout_s=3.0))
    assert a.completion == crash + "\nZeroDivisionError: division by zero\n```\n \\boxed{0}", a.tool_outputs
    assert a.tool_outputs[0].failed
    assert b.completion == slow + "\nTimeout Error\n```\n \\boxed{1}"
    assert b.tool_outputs[0].timed_out


def test_rollout_handles_overhang_and_missing_program():
    # A tokenizer's last token may carry the newline after "```output": it is kept, not doubled.
    overhang = "```python\nprint(5)\n```\n```output\n"
    no_code = "I will now show the output\n```output"
    script = Script({"A": [overhang, "done"], "B": [no_code]})
    (a, b), reasons, _ = tir(script, ["A", "B"])
    assert a.completion == overhang + "5\n```\ndone" and a.tool_outputs[0].text == "\n5\n```\n"
    assert (b.completion, b.tool_calls, reasons) == (no_code, 0, ["answer", "no_program"])
    # "```output" inside the text but not at the end is not a stop.
    script = Script({"C": [f"the marker {OUTPUT_STOP} appears mid-text"]})
    assert tir(script, ["C"])[1] == ["answer"]


def test_rollout_counts_tool_output_in_the_length_limit_and_checks_its_inputs():
    call = "```python\nprint(12345)\n```\n```output"  # 32 characters; the output block adds 11
    (cut,), reasons, _ = tir(Script({"Q": [call, "never"]}), ["Q"], max_new_tokens=len(call) + 5)
    assert cut.completion == call + "\n1234" and reasons == ["length"]
    with pytest.raises(ValueError, match="max_tool_calls"):
        tir(Script({"Q": []}), ["Q"], max_tool_calls=0)
    assert tir(Script({}), [])[:2] == ([], [])
    with pytest.raises(ValueError, match="cannot continue from token ids"):
        rollouts(object(), TOKENIZER, ["Q"], "tir", SamplingParams(8), RolloutLimits(100), Timings())
