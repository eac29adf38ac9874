"""The built-in chain task: solutions, step grades, answer extraction, disjoint splits."""

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.data import arithmetic


def test_solve_and_format():
    steps, answer = arithmetic.solve("7+5-3+9")
    assert steps == ["12-3+9", "9+9"] and answer == 18
    assert arithmetic.format_solution("7+5-3+9") == "12-3+9\n9+9\nA: 18"
    assert arithmetic.format_solution("7+5") == "A: 12"  # one operation: the answer line does it
    assert arithmetic.format_prompt("7+5") == "Q: 7+5\n"
    assert arithmetic.reduce_once("12-3+9") == "9+9" and arithmetic.reduce_once("3-5") == "-2"
    with pytest.raises(ValueError, match="not a chain"):
        arithmetic.reduce_once("12")


def test_check_steps_grades_each_line_against_the_line_above():
    q = "7+5-3+1"
    assert arithmetic.check_steps(q, "12-3+1\n9+1\nA: 10") == [True, True]
    assert arithmetic.check_steps(q, "13-3+1\n10+1\nA: 11") == [False, True]  # wrong sum, then consistent
    assert arithmetic.check_steps(q, "12-4+1\n8+1\nA: 9") == [False, True]  # miscopied operand
    assert arithmetic.check_steps(q, "12-3+1\n8+1\nA: 9") == [True, False]  # wrong difference
    assert arithmetic.check_steps(q, "12-3+1\n9\nA: 9") == [True, False]  # skips an operation
    assert arithmetic.check_steps(q, "garbage\nnonsense\nA: 9") == [False, False]
    assert arithmetic.check_steps(q, "A: 10") == []


def test_splits_are_disjoint_and_reproducible():
    task = arithmetic.ChainSpec()
    train = arithmetic.sample_questions(2000, 0, task, "train")
    heldout = arithmetic.sample_questions(300, 0, task, "heldout")
    assert not set(train) & set(heldout)
    assert len(set(train)) == 2000 and len(set(heldout)) == 300
    assert arithmetic.sample_questions(50, 0, task, "train") == train[:50]
    assert all(arithmetic.is_heldout(q, task.heldout_percent) for q in heldout)


def test_questions_respect_the_task_bounds():
    task = arithmetic.ChainSpec(min_ops=2, max_ops=3, max_start=20, max_operand=5, max_value=30)
    for q in arithmetic.sample_questions(300, 1, task, "train"):
        steps, answer = arithmetic.solve(q)
        assert 1 <= len(steps) <= 2  # one line fewer than operations: the answer line does the last
        for step in steps:
            assert 0 <= int(re.match(r"\d+", step).group()) <= 30
        assert 0 <= answer <= 30


def test_bad_task_is_rejected():
    with pytest.raises(ValueError, match="min_ops"):
        arithmetic.ChainSpec(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="split must be"):
        arithmetic.sample_questions(1, 0, arithmetic.ChainSpec(), "dev")


def test_shows_steps():
    assert arithmetic.shows_steps("12-3\nA: 9")
    assert not arithmetic.shows_steps("A: 12")
    assert not arithmetic.shows_steps("A: 12\n12-3")
    assert not arithmetic.shows_steps("seven plus five\nA: 12")


def test_worked_rates_by_hand():
    # Three worked (two right), two direct (one right): 3/5 show steps, 2/3 of worked and 1/2 of
    # direct answers are right; accuracy 3/5 = 3/5 x 2/3 + 2/5 x 1/2.
    completions = ["12-3\nA: 9", "12-3\nA: 8", "5+1\nA: 6", "A: 12", "A: 4"]
    rates = arithmetic.worked_rates(completions, [True, False, True, True, False])
    assert rates == {"shows its steps": 0.6, "right if worked": 2 / 3, "right if direct": 0.5}
    only_direct = arithmetic.worked_rates(["A: 1"], [True])
    assert math.isnan(only_direct["right if worked"]) and only_direct["right if direct"] == 1.0


def test_demo_table_shows_worked_and_direct_accuracy():
    from grpokit.config import Config
    from grpokit.eval.evaluate import EvalResult
    from grpokit.pipeline.report import format_table
    from grpokit.tasks.chain import ChainTask

    before = EvalResult(0.5, 0.6, 0.5, 8, 4, ["A: 1", "A: 2", "3-1\nA: 2", "3-1\nA: 3"], [True, False, True, False])
    after = EvalResult(0.75, 0.8, 0.75, 8, 4, ["3-1\nA: 2"] * 3 + ["3-1\nA: 1"], [True, True, True, False])
    table = format_table(ChainTask(Config()), before, after).splitlines()
    assert "shows its steps    50.0%  100.0%   +50.0pt" in table
    assert "right if worked    50.0%   75.0%   +25.0pt" in table
    assert "right if direct    50.0%       -          " in table  # no direct answer after: no rate, no change
    # d = [0, 1, 0, 0]: +25 pt; s = 1/2, so the interval is 0.25 +- 1.96 * 0.5 / 2
    assert "greedy change: +25.0 pt, 95% interval [-24.0, +74.0] pt (4 questions: 1 gained, 0 lost)" in table


# --- tool-integrated demonstrations ---------------------------------------------------------


def test_tir_prompt_and_demonstration_golden():
    assert arithmetic.format_tir_prompt("7+5-3+9") == "Q: 7+5-3+9 (with python)\n"
    assert arithmetic.format_tir_solution("7+5-3+9") == "```python\nprint(7+5-3+9)\n```\n```output\n18\n```\nA: 18"
    [row] = arithmetic.make_tir_rows(["3-5"])
    assert row == {"prompt": "Q: 3-5 (with python)\n", "question": "3-5", "answer": "-2",
                   "solution": "```python\nprint(3-5)\n```\n```output\n-2\n```\nA: -2"}


def test_tir_demonstrations_show_exactly_what_the_harness_appends():
    """Cut a demonstration at "```output": running its program in the sandbox and formatting the
    result as the TIR rollout does gives back the rest of the demonstration up to the answer."""
    from grpokit.tools.python import OUTPUT_STOP, cumulative_program, format_tool_output
    from grpokit.tools.sandbox import run_many

    questions = ["7+5-3+9", "3-5", "20-9-9-1+4"]
    demos = [arithmetic.format_tir_solution(q) for q in questions]
    heads = [d[: d.index(OUTPUT_STOP) + len(OUTPUT_STOP)] for d in demos]
    results = run_many([cumulative_program(h) for h in heads])
    for demo, head, result in zip(demos, heads, results):
        answer_line = demo.rsplit("\n", 1)[1]
        assert head[: -len(OUTPUT_STOP)] + format_tool_output(result) + answer_line == demo


def test_the_tir_alphabet_spells_every_tir_prompt_and_demonstration():
    rows = arithmetic.make_tir_rows(arithmetic.sample_questions(200, 0, arithmetic.ChainSpec(), "train"))
    text = "".join(r["prompt"] + r["solution"] for r in rows)
    assert set(text) <= set(arithmetic.TIR_ALPHABET)
    assert not set("`()") & set(arithmetic.ALPHABET)  # the CoT-only alphabet cannot write a program


# --- one-slip twins (hard negatives for reward models) ----------------------------------------


def test_one_slip_golden():
    rng = random.Random(0)
    assert arithmetic.one_slip("7+5-3+9", "12-3+9\n9+9\nA: 18", rng) == "12-3+9\n10+9\nA: 19"
    assert arithmetic.one_slip("7+5", "A: 12", random.Random(1)) in {f"A: {v}" for v in (9, 10, 11, 13, 14, 15)}
    # Not a right solution: no twin.
    assert arithmetic.one_slip("7+5", "A: 13", rng) is None
    assert arithmetic.one_slip("7+5-1", "12-1\nA: 10", rng) is None
    assert arithmetic.one_slip("7+5-1", "garbage", rng) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_one_slip_changes_one_result_and_carries_on_from_it(seed, worked):
    rng = random.Random(seed)
    question = arithmetic.random_question(rng, arithmetic.ChainSpec())
    steps, answer = arithmetic.solve(question)
    right = arithmetic.format_solution(question) if worked else f"A: {answer}"
    twin = arithmetic.one_slip(question, right, rng)
    lines = twin.split("\n")
    assert len(lines) == len(right.split("\n"))  # the same layout
    assert arithmetic.extract_answer(twin) != str(answer)  # the answer is wrong
    grades = arithmetic.check_steps(question, twin)
    assert grades.count(False) <= 1  # at most one step line slipped; every other follows from the line above
    labels = arithmetic.step_labels(question, lines, str(answer))
    first_wrong = labels.index(False)
    assert all(labels[:first_wrong]) and not any(labels[first_wrong:])
    assert lines[:first_wrong] == right.split("\n")[:first_wrong]  # unchanged before the slip
