"""Countdown: golden answers graded by hand, questions from seeds, and a tiny train run."""

import json
import subprocess
import sys

import pytest

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.tasks import TASKS, task_for
from grpokit.tasks import countdown as cd

NUMBERS, TARGET = [3, 7, 25, 2], 46


@pytest.mark.parametrize("expression, right", [
    ("25*2-7+3", True),
    ("25*2-(7-3)", True),
    (" 25 * 2 - 7 + 3 ", True),  # spaces change nothing
    ("(25*2)-7+3", True),
    ("25+25-7+3", False),  # 46, but 25 is given once
    ("25*2-7+3+3", False),  # 3 used twice (and 49)
    ("46", False),  # 46 is not given
    ("(25-7)*3-2*4", False),  # 46, but 4 is not given
    ("25*2-7", False),  # 43: numbers may go unused, the value must still be the target
    ("25*2/0", False),  # division by zero is wrong, not an error
    ("25*2-7+3/(7-7)", False),
    ("__import__('os')", False),
    ("__import__('os').system('echo hacked')", False),
    ("3+43", False),
    ("25*2-7+3.0", False),  # a decimal point: no given number
    ("0x19*2-7+3", False),  # 25 in hex is not the 25 given
    ("-3+49", False),  # a unary minus is no operation of the task
    ("2**5+7+3", False),  # nor a power
    ("25*2-7+3,", False),
    ("25*2 -7 +3 = 46", False),
    ("", False),
])
def test_golden_answers(expression, right):
    assert cd.is_solution(expression, NUMBERS, TARGET) is right


def test_division_is_exact():
    """Fractions: 2/3 is no rounded float, so (2/3+1)*9 is 15 (floats make it 14.999999999999998)."""
    assert eval("(2/3+1)*9") != 15
    assert cd.is_solution("(2/3+1)*9", [2, 3, 1, 9], 15)
    assert cd.is_solution("7/2*2+25", [7, 2, 2, 25], 32)  # 7/2 is 7/2 on the way, 7 after *2
    assert not cd.is_solution("7/2*2+25", [7, 2, 25, 3], 32)  # the second 2 is not given
    assert not cd.is_solution("7/2+25", [7, 2, 25], 28)  # 28.5 is not 28


def test_nothing_in_an_answer_runs(monkeypatch):
    import builtins

    monkeypatch.setattr(builtins, "__import__", lambda *a, **k: pytest.fail("an answer was run"))
    assert cd.evaluate("__import__('os').system('true')") is None
    assert cd.evaluate("(lambda: 1)()") is None and cd.evaluate("x") is None


def test_overlong_answers_are_wrong_unread():
    assert cd.evaluate("(" * 99 + "1" + ")" * 99)[0] == 1  # deep, but short enough to read
    assert cd.evaluate("(" * 500 + "1" + ")" * 500) is None
    assert cd.evaluate("+".join(["1"] * 101)) is None  # past MAX_ANSWER_CHARS


def test_extract_answer_and_grade():
    task = task_for(load_config(overrides=["--task.name=countdown"]))
    assert task.extract_answer("A: 25*2-7+3") == "25*2-7+3"
    assert task.extract_answer("25*2=50\nA: 25*2-7+3\nA: 25*2-7+3") == "25*2-7+3"
    assert task.extract_answer("A: 25*2-7+3\nA: 46") is None and task.extract_answer("no answer") is None
    rows = [{"prompt": cd.format_prompt(NUMBERS, TARGET), "numbers": NUMBERS, "target": TARGET}] * 4
    completions = ["A: 25*2-7+3", "A: 46", "A: __import__('os')", "46"]
    assert task.grade(rows, completions) == [True, False, False, False]
    assert cd.countdown_accuracy([r["prompt"] for r in rows], completions, numbers=[NUMBERS] * 4,
                                 target=[TARGET] * 4, answer=["46"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_the_task_is_registered_and_brings_its_reward():
    assert TASKS["countdown"] is cd.CountdownTask
    config = load_config(overrides=["--task.name=countdown"])
    assert [r.name for r in config.rewards] == ["grpokit.tasks.countdown:countdown_accuracy"]
    with pytest.raises(ConfigError, match=r"task.name: unknown task 'countdwn' \(did you mean 'countdown'\?\)"):
        load_config(overrides=["--task.name=countdwn"])


def test_questions_come_from_the_seed():
    a, b = cd.sample_questions(200, 5, "train", 10), cd.sample_questions(200, 5, "train", 10)
    assert a == b and a != cd.sample_questions(200, 6, "train", 10)
    assert len({q.key for q in a}) == 200  # distinct, in any order of the numbers


def test_every_question_is_solvable_and_the_splits_never_meet():
    train = cd.sample_questions(3000, 0, "train", 10) + cd.sample_questions(3000, 1, "train", 10)
    heldout = cd.sample_questions(300, 0, "heldout", 10)
    assert not {q.key for q in train} & {q.key for q in heldout}
    for q in train + heldout:
        assert cd.MIN_NUMBERS <= len(q.numbers) <= cd.MAX_NUMBERS and all(1 <= n <= cd.MAX_NUMBER for n in q.numbers)
        assert 1 <= q.target <= cd.MAX_TARGET and q.target not in q.numbers
        assert cd.is_solution(q.solution, q.numbers, q.target), q


def test_data_gives_demonstrations_rl_and_heldout_rows(tmp_path):
    config = load_config(overrides=["--task.name=countdown", "--num_sft_examples=50", "--num_rl_questions=80",
                                    "--num_eval_questions=20", "--seed=3"])
    task = task_for(config)
    data = task.data(None)
    assert (len(data.sft), len(data.train), len(data.heldout)) == (50, 80, 20)
    demo = data.sft[0]
    assert demo["prompt"].startswith("Numbers: ") and demo["completion"].startswith("A: ")
    rows = [{"numbers": [int(n) for n in d["prompt"].split("\n")[0].split()[1:]],
             "target": int(d["prompt"].split("\n")[1].removeprefix("Target: "))} for d in data.sft]
    assert task.grade(rows, [d["completion"] for d in data.sft]) == [True] * 50
    assert set(data.train[0]) == {"prompt", "numbers", "target", "answer"}
    assert task.grade(data.heldout, [r["solution"] for r in data.heldout]) == [True] * 20
    # held-out questions are the same whatever the seed, as the chain task's
    other = task_for(load_config(overrides=["--task.name=countdown", "--num_eval_questions=20", "--seed=4"]))
    assert other.data(None, sft=False).heldout == data.heldout
    assert task.data(None, sft=False).sft == [] and task.tir_rows(data.heldout, None) is None


def test_a_tokenizer_that_cannot_spell_the_task_is_refused(tokenizer):
    task = task_for(load_config(overrides=["--task.name=countdown", "--num_sft_examples=1"]))
    with pytest.raises(ConfigError, match="use model.tiny.alphabet=ascii"):
        task.data(tokenizer)


def test_report_counts_well_formed_answers():
    from grpokit.eval import EvalResult

    result = EvalResult(0.0, 0.0, 0.0, 1, 4, greedy_completions=["A: 1+2", "A: 1+", "A: 1/0", "A: (3)*4"])
    task = task_for(load_config(overrides=["--task.name=countdown"]))
    assert task.report(result) == {"valid syntax": 0.5}


def test_train_runs_on_the_tiny_model(tmp_path):
    """`grpokit train --task.name=countdown` end to end: 2 GRPO steps, graded by countdown's rule."""
    out = tmp_path / "run"
    args = ["--task.name=countdown", "--model.tiny.alphabet=ascii", "--model.tiny.hidden_size=32",
            "--model.tiny.num_layers=2", "--model.tiny.num_heads=2", "--model.tiny.intermediate_size=64",
            "--num_rl_questions=32", "--num_eval_questions=4", "--eval.k=2", "--grpo.max_steps=2",
            "--prompts_per_step=2", "--num_generations=4", "--max_completion_length=16"]
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", f"--output_dir={out}", "--quiet", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out greedy accuracy" in proc.stdout and "valid syntax" in proc.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all("rewards/grpokit.tasks.countdown:countdown_accuracy" in s for s in steps), steps[0]
    config = load_config(out / "config.yaml")
    assert config.task.name == "countdown"
    assert [r.name for r in config.rewards] == ["grpokit.tasks.countdown:countdown_accuracy"]
