"""The validation split: beside the held-out questions, by the same hash, disjoint from training and
from the held-out test; what it leaves unchanged; and the one-line refusals of a split too large."""

import json
import re

import pytest

from grpokit.checks import load_config
from grpokit.data import arithmetic, split
from grpokit.data.split import heldout_position, is_heldout, split_of
from grpokit.errors import ConfigError
from grpokit.eval.validation import validation_summary
from grpokit.tasks.chain import ChainTask
from grpokit.tasks.countdown import CountdownTask
from grpokit.models.tiny import build_char_tokenizer
from grpokit.tasks.math import MathTask

ASCII = build_char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")


def test_the_hash_puts_a_question_on_one_side_held_out_first():
    keys = [f"{a}+{b}-{c}" for a in range(20) for b in range(10) for c in range(10)]
    sides = {k: split_of(k, 0.10, 0.05) for k in keys}
    assert set(sides.values()) == {"heldout", "validation", "train"}
    for key, side in sides.items():  # the held-out side is exactly is_heldout's, whatever the validation share
        assert (side == "heldout") == is_heldout(key, 0.10) == (split_of(key, 0.10) == "heldout")
        assert (side == "validation") == (0.10 <= heldout_position(key) < 0.15)
    assert 0.03 < sum(s == "validation" for s in sides.values()) / len(keys) < 0.07


def test_a_question_at_exactly_the_validation_share_s_end_trains(monkeypatch):
    """0.1 + 0.05 is 0.15000000000000002 in floats: a question at position 0.15 (crc32 % 100 == 15, about
    one in 10^8 questions, hence the stand-in position) must still train, as crc32 % 100 < 15 says."""
    monkeypatch.setattr(split, "heldout_position", lambda key: 15 / 100)
    assert split_of("q", 0.10, 0.05) == "train" and split_of("q", 0.10, 0.06) == "validation"
    assert split_of("q", 0.15, 0.05) == "validation"


def _chain(*overrides):
    return ChainTask(load_config(overrides=["--task.num_sft_examples=300", "--task.num_rl_questions=300",
                                            "--task.num_eval_questions=200", *overrides]))


def test_the_chain_task_s_validation_questions_are_neither_trained_on_nor_held_out():
    data = _chain().data()
    validation = {r["question"] for r in data.validation}
    assert len(validation) == 200  # task.num_validation_questions' default
    trained = {r["question"] for r in data.train} | {r["prompt"] for r in data.sft}
    assert not validation & trained and not validation & {r["question"] for r in data.heldout}
    spec = arithmetic.ChainSpec(validation_percent=5)
    assert all(arithmetic.split_of(q, spec) == "validation" for q in validation)
    assert all(arithmetic.split_of(r["question"], spec) == "train" for r in data.train)
    assert set(data.validation[0]) >= {"prompt", "question", "answer"}


def test_validation_asks_at_most_as_many_questions_as_the_held_out_test():
    assert len(_chain("--task.num_eval_questions=8").data(sft=False).validation) == 8


def test_the_held_out_questions_do_not_move_and_no_validation_gives_the_old_training_draws():
    with_validation, without = _chain().data(), _chain("--task.validation_percent=0").data()
    assert with_validation.heldout == without.heldout  # reported numbers stay on the same questions
    assert without.validation == [] and _chain("--task.num_validation_questions=0").data().validation == []
    # validation_percent=0: the training draws of the code before the split (the sampler as it was)
    spec = arithmetic.ChainSpec()
    assert [r["question"] for r in without.train] == arithmetic.sample_questions(300, 1, spec, "train")
    assert [r["question"] for r in with_validation.train] != [r["question"] for r in without.train]


def test_countdown_has_a_validation_split_too():
    config = load_config(overrides=["--task.name=countdown", "--task.num_sft_examples=50",
                                    "--task.num_rl_questions=50", "--task.num_eval_questions=20",
                                    "--task.num_validation_questions=20", "--model.tiny.alphabet=ascii"])
    data = CountdownTask(config).data(ASCII)
    questions = {r["prompt"] for r in data.validation}
    assert len(questions) == 20
    assert not questions & {r["prompt"] for r in data.heldout} and not questions & {r["prompt"] for r in data.train}


def test_the_math_task_splits_validation_off_the_sources_by_the_same_hash(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(400)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(overrides=[f"--data.sources=[{{path: {tmp_path / 'q.jsonl'}, format: gsm8k}}]",
                                    "--data.template=none", "--data.chat_template=off",
                                    "--data.heldout_fraction=0.1", "--data.validation_fraction=0.1"])
    data = MathTask(config).data(ASCII)
    sides = {r["question"]: split_of(r["question"], 0.1, 0.1) for r in rows}
    assert {r["question"] for r in data.validation} == {q for q, s in sides.items() if s == "validation"}
    assert {r["question"] for r in data.heldout} == {q for q, s in sides.items() if s == "heldout"}
    assert {r["question"] for r in data.train} == {q for q, s in sides.items() if s == "train"}
    assert 20 < len(data.validation) < 60


@pytest.mark.parametrize(("overrides", "message"), [
    (["--task.heldout_percent=60", "--task.validation_percent=40"],
     "task.heldout_percent (60) + task.validation_percent (40) leave no questions to train on"),
    (["--data.heldout_fraction=0.5", "--data.validation_fraction=0.5"],
     "data.heldout_fraction (0.5) + data.validation_fraction (0.5) leave no questions to train on"),
    (["--task.validation_percent=-1"], "task.validation_percent must be >= 0"),
])
def test_a_split_that_leaves_nothing_to_train_on_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as error:
        load_config(overrides=overrides)
    assert "\n" not in str(error.value)


def test_more_validation_questions_than_the_share_holds_is_refused_naming_the_key_and_sizes():
    small = ["--task.min_ops=1", "--task.max_ops=1", "--task.max_start=9", "--task.max_operand=9", "--task.heldout_percent=40",
             "--task.max_value=20", "--task.num_sft_examples=1", "--task.num_rl_questions=1",
             "--task.num_eval_questions=30", "--task.validation_percent=20", "--task.num_validation_questions=40"]
    with pytest.raises(ConfigError) as error:
        _chain(*small).data(sft=False)
    message = str(error.value)
    assert message == ("task.num_validation_questions=40 asks for more validation questions than "
                       "task.validation_percent=20 holds (23 distinct ones drawn): lower "
                       "task.num_validation_questions or raise task.validation_percent")  # docs/reference/errors.md


def test_the_summary_s_validation_is_before_after_and_their_change(capsys):
    before = {"questions": 200, "greedy_accuracy": 0.5, "seconds": 1.0}
    after = {"questions": 200, "greedy_accuracy": 0.75, "seconds": 2.0}
    assert validation_summary(before, after) == {"validation": {
        "questions": 200, "before": 0.5, "after": 0.75, "change_points": 25.0, "seconds": 3.0}}
    assert "greedy 50.0% -> 75.0%" in capsys.readouterr().out
    assert validation_summary({}, after)["validation"]["before"] is None
    assert validation_summary({}, {}) == {}
