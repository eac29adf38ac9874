"""Tools by name (grpokit.tools): the registry, the harness that keeps a crashing tool from
taking a batch down, and the Python sandbox tool with DeepSeekMath's output blocks."""

import time

import pytest

from grpokit.tools import TOOLS, ToolOutput, appended_text, make_tool, register_tool, run_calls, stopped_at
from grpokit.tools.python import OUTPUT_STOP, PythonTool


def test_the_python_tool_is_registered_and_lookup_names_the_registered_tools():
    tool = make_tool("python", timeout_s=5.0)
    assert isinstance(tool, PythonTool) and TOOLS["python"] is PythonTool
    assert (tool.name, tool.stop, tool.timeout_s) == ("python", OUTPUT_STOP, 5.0)
    assert tool.instruction.startswith("Please integrate natural language reasoning with programs")
    with pytest.raises(ValueError, match=r"unknown tool 'pyhton' \(did you mean 'python'\?\); registered: .*python"):
        make_tool("pyhton")
    with pytest.raises(ValueError, match="program must be one of"):
        make_tool("python", program="whole")


def test_a_name_registered_twice_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        register_tool("python")(type("Other", (), {}))


def test_the_python_tool_runs_programs_in_parallel_with_deepseekmath_output_blocks():
    tool = PythonTool(timeout_s=3.0)
    completion = "```python\nx = 6 * 7\nprint(x)\n```\n```output\n42\n```\nthen\n```python\nprint(x + 1)\n```\n```output"
    assert tool.parse(completion) == "x = 6 * 7\nprint(x + 1)"  # earlier prints dropped, variables kept
    assert PythonTool(program="last_block").parse(completion) == "print(x + 1)"
    assert tool.parse("no program\n```output") is None
    long = "print('a' * 60 + 'b' * 60)"
    start = time.perf_counter()
    ok, crash, slow, big = tool.run(["print(2**10)", "print('partial')\n1 / 0", "while True:\n    pass", long])
    assert (ok.text, ok.failed, ok.timed_out, ok.error) == ("\n1024\n```\n", False, False, None)
    assert (crash.text, crash.failed, crash.timed_out) == ("\nZeroDivisionError: division by zero\n```\n", True, False)
    assert (slow.text, slow.failed, slow.timed_out) == ("\nTimeout Error\n```\n", True, True)
    assert big.text == "\n" + "a" * 50 + "..." + "b" * 50 + "\n```\n"
    assert slow.seconds >= 3.0 and 0 < ok.seconds < 3.0
    assert time.perf_counter() - start < 2 * 3.0 + 5  # in parallel: the slow one does not wait for the others


class Flaky:
    """Raises on any batch holding "boom"; answers the others with their length."""

    name, stop, instruction = "flaky", "=>", ""

    def parse(self, completion):
        return completion

    def run(self, calls):
        if "boom" in calls:
            raise RuntimeError("the tool broke")
        return [ToolOutput(str(len(c))) for c in calls]


def test_a_tool_that_raises_fails_only_its_own_sample():
    outputs = run_calls(Flaky(), ["ab", "boom", "abc"])
    assert [o.text for o in outputs] == ["2", "", "3"]
    assert [o.error for o in outputs] == [None, "RuntimeError: the tool broke", None]
    assert outputs[1].failed and not outputs[0].failed
    assert run_calls(Flaky(), []) == []


def test_a_tool_returning_the_wrong_number_of_outputs_is_an_error():
    class Short(Flaky):
        def run(self, calls):
            return []

    with pytest.raises(ValueError, match="returned 0 outputs for 1 calls"):
        run_calls(Short(), ["x"])


def test_stop_and_overhang():
    assert stopped_at("x```output", OUTPUT_STOP) == ""
    assert stopped_at("x```output\n", OUTPUT_STOP) == "\n"
    assert stopped_at("x```output and more", OUTPUT_STOP) is None
    assert stopped_at("no stop", OUTPUT_STOP) is None
    assert appended_text("\n4\n```\n", "") == "\n4\n```\n"
    assert appended_text("\n4\n```\n", "\n") == "4\n```\n"  # the newline the policy wrote is not doubled
    assert appended_text("4", "\n") == "4"
