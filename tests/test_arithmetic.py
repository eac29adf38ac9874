"""The built-in chain task: solutions, step grades, answer extraction, disjoint splits."""

import pytest

from grpokit.data import arithmetic


def test_solve_and_format():
    steps, answer = arithmetic.solve("7+5-3+9")
    assert steps == ["7+5=12", "12-3=9", "9+9=18"] and answer == 18
    assert arithmetic.format_solution("7+5-3+9") == "7+5=12\n12-3=9\n9+9=18\nA: 18"
    assert arithmetic.format_prompt("7+5") == "Q: 7+5\n"


def test_check_steps_grades_each_line():
    q = "7+5-3"
    assert arithmetic.check_steps(q, "7+5=12\n12-3=9\nA: 9") == [True, True]
    assert arithmetic.check_steps(q, "7+5=13\n13-3=10\nA: 10") == [False, True]  # wrong sum, then consistent
    assert arithmetic.check_steps(q, "7+5=12\n12-4=8\nA: 8") == [True, False]  # wrong operand
    assert arithmetic.check_steps(q, "7+5=12\n11-3=8\nA: 8") == [True, False]  # does not carry the result
    assert arithmetic.check_steps(q, "garbage\nA: 9") == [False]


def test_splits_are_disjoint_and_reproducible():
    task = arithmetic.ChainTask()
    train = arithmetic.sample_questions(2000, 0, task, "train")
    heldout = arithmetic.sample_questions(300, 0, task, "heldout")
    assert not set(train) & set(heldout)
    assert len(set(train)) == 2000 and len(set(heldout)) == 300
    assert arithmetic.sample_questions(50, 0, task, "train") == train[:50]
    assert all(arithmetic.is_heldout(q, task.heldout_percent) for q in heldout)


def test_questions_respect_the_task_bounds():
    task = arithmetic.ChainTask(min_ops=2, max_ops=3, max_start=20, max_operand=5, max_value=30)
    for q in arithmetic.sample_questions(300, 1, task, "train"):
        steps, _ = arithmetic.solve(q)
        assert 2 <= len(steps) <= 3
        for step in steps:
            assert 0 <= int(step.split("=")[1]) <= 30


def test_bad_task_is_rejected():
    with pytest.raises(ValueError, match="min_ops"):
        arithmetic.ChainTask(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="split must be"):
        arithmetic.sample_questions(1, 0, arithmetic.ChainTask(), "dev")


def test_shows_steps():
    assert arithmetic.shows_steps("7+5=12\nA: 12")
    assert not arithmetic.shows_steps("A: 12")
    assert not arithmetic.shows_steps("seven plus five\nA: 12")
