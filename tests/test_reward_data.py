"""Reward-model training data: preference pairs, graded samples, step labels, and their errors."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.data.files import DatasetError
from grpokit.data.reward_data import (
    GradedSample,
    PreferencePair,
    StepLabelledSample,
    pairs_from_graded,
    read_graded_samples,
    read_preference_pairs,
    read_step_labels,
    split_steps,
    write_jsonl,
)


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


PAIR = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}


# --- preference pairs ---------------------------------------------------------------------------

def test_preference_pairs_golden(tmp_path):
    path = jsonl(tmp_path / "pairs.jsonl", [PAIR, {"prompt": "p", "chosen": "é", "rejected": "b", "id": 7}])
    assert read_preference_pairs(path) == [PreferencePair("2+2?", "4", "5"), PreferencePair("p", "é", "b")]


@pytest.mark.parametrize("bad, field, words", [
    ({"prompt": "p", "rejected": "r"}, "chosen", "no field"),
    ({"prompt": "p", "chosen": 4, "rejected": "r"}, "chosen", "must be text"),
    ({"prompt": "  ", "chosen": "c", "rejected": "r"}, "prompt", "is empty"),
    ({"prompt": "p", "chosen": "c", "rejected": None}, "rejected", "must be text"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected", "same text"),
])
def test_preference_pair_errors_name_line_and_field(tmp_path, bad, field, words):
    path = jsonl(tmp_path / "pairs.jsonl", [PAIR, PAIR, bad])
    with pytest.raises(DatasetError) as err:
        read_preference_pairs(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: ")
    assert f"'{field}'" in message and words in message
    assert message.endswith("; or set data.skip_malformed_lines=true to skip and count such rows")


def test_preference_pairs_skip_malformed(tmp_path, capsys):
    path = jsonl(tmp_path / "pairs.jsonl", [PAIR, "{not json", {"prompt": "p"}, [1, 2],
                                            {"prompt": "p", "chosen": "x", "rejected": "x"}, PAIR])
    assert read_preference_pairs(path, skip_malformed=True) == [PreferencePair("2+2?", "4", "5")] * 2
    assert capsys.readouterr() == ("", "")
    with pytest.raises(DatasetError, match=r"pairs\.jsonl:2: not valid JSON"):
        read_preference_pairs(path)


def test_no_usable_rows_names_the_file(tmp_path):
    path = jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p"}])
    with pytest.raises(DatasetError, match=r"pairs\.jsonl: no usable rows \(1 skipped, first: .*pairs\.jsonl:1: "):
        read_preference_pairs(path, skip_malformed=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: no usable rows \(0 skipped\)"):
        read_preference_pairs(empty)


def test_non_object_row(tmp_path):
    path = jsonl(tmp_path / "pairs.jsonl", ['"text"'])
    with pytest.raises(DatasetError, match=r"pairs\.jsonl:1: expected a JSON object, got str"):
        read_preference_pairs(path)


def test_json_list_locations_are_row_indices(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps({"data": [PAIR, {"prompt": "p", "chosen": "c"}]}))
    with pytest.raises(DatasetError) as err:
        read_preference_pairs(path)
    assert str(err.value).startswith(f"{path}[row 1]: no field 'rejected'")
    path.write_text(json.dumps([PAIR]))
    assert read_preference_pairs(path) == [PreferencePair("2+2?", "4", "5")]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed; Parquet reading needs it")
    import pyarrow.parquet as pq

    path = tmp_path / "graded.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "completion": "a", "label": 1},
                                         {"prompt": "p", "completion": "b", "label": None}]), path)
    with pytest.raises(DatasetError) as err:
        read_graded_samples(path)
    assert str(err.value).startswith(f"{path}[row 1]: no grade")
    assert read_graded_samples(path, skip_malformed=True) == [GradedSample("p", "a", True)]


# --- graded samples -----------------------------------------------------------------------------

def test_graded_samples_golden(tmp_path):
    path = jsonl(tmp_path / "graded.jsonl", [
        {"prompt": "p", "completion": "a", "correct": True},
        {"prompt": "p", "completion": "b", "correct": 0},
        {"prompt": "p", "completion": "c", "label": 1},
        {"prompt": "p", "completion": "", "label": False},
        {"prompt": "p", "completion": "e", "reward": 0.9},
        {"prompt": "p", "completion": "f", "reward": 0.5},
        {"prompt": "p", "completion": "g", "correct": None, "reward": 1},
    ])
    assert [(s.completion, s.correct) for s in read_graded_samples(path)] == [
        ("a", True), ("b", False), ("c", True), ("", False), ("e", True), ("f", False), ("g", True)]


@pytest.mark.parametrize("bad, field", [
    ({"prompt": "p", "completion": "a"}, "no grade"),
    ({"prompt": "p", "completion": "a", "correct": "yes"}, "'correct'"),
    ({"prompt": "p", "completion": "a", "label": 2}, "'label'"),
    ({"prompt": "p", "completion": "a", "label": 1.0}, "'label'"),
    ({"prompt": "p", "completion": "a", "reward": "high"}, "'reward'"),
    ({"prompt": "p", "completion": "a", "reward": float("nan")}, "'reward'"),
])
def test_graded_sample_grade_errors_list_accepted_fields(tmp_path, bad, field):
    good = {"prompt": "p", "completion": "a", "correct": True}
    path = jsonl(tmp_path / "graded.jsonl", [good, good, bad])
    with pytest.raises(DatasetError) as err:
        read_graded_samples(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: ") and field in message
    assert all(name in message for name in ("'correct'", "'label'", "'reward'"))
    assert read_graded_samples(path, skip_malformed=True) == [GradedSample("p", "a", True)] * 2


def test_graded_sample_missing_completion(tmp_path):
    path = jsonl(tmp_path / "graded.jsonl", [{"prompt": "p", "correct": True}])
    with pytest.raises(DatasetError) as err:
        read_graded_samples(path)
    assert str(err.value).startswith(f"{path}:1: no field 'completion'")


# --- pairs from graded samples ------------------------------------------------------------------

def graded(prompt, correct, incorrect):
    return ([GradedSample(prompt, c, True) for c in correct]
            + [GradedSample(prompt, c, False) for c in incorrect])


def test_pairs_from_graded_golden():
    samples = graded("q1", ["r1", "r2"], ["w1"]) + graded("q2", ["only right"], []) + graded("q0", [], ["w"])
    samples += graded("q3", ["same", "r"], ["same"])
    assert pairs_from_graded(samples) == [
        PreferencePair("q1", "r1", "w1"), PreferencePair("q1", "r2", "w1"), PreferencePair("q3", "r", "same")]


def test_pairs_from_graded_keeps_first_seen_prompt_order():
    samples = graded("b", [], ["w"]) + graded("a", ["r"], ["w"]) + graded("b", ["r"], [])
    assert [p.prompt for p in pairs_from_graded(samples)] == ["b", "a"]


def test_pairs_from_graded_cap_and_determinism():
    samples = graded("q", [f"r{i}" for i in range(10)], [f"w{i}" for i in range(10)] + ["r3"])
    first = pairs_from_graded(samples, seed=1, max_pairs_per_prompt=5)
    assert len(first) == 5 and len(set(first)) == 5
    assert all(p.chosen.startswith("r") and p.chosen != p.rejected for p in first)
    assert pairs_from_graded(samples, seed=1, max_pairs_per_prompt=5) == first
    others = {tuple(pairs_from_graded(samples, seed=s, max_pairs_per_prompt=5)) for s in range(2, 8)}
    assert len(others | {tuple(first)}) > 1  # the seed matters
    assert len(pairs_from_graded(samples, max_pairs_per_prompt=1000)) == 10 * 11 - 1  # r3 with itself left out
    with pytest.raises(ValueError):
        pairs_from_graded(samples, max_pairs_per_prompt=0)


# --- step labels --------------------------------------------------------------------------------

def test_step_labels_from_steps_and_from_completion(tmp_path):
    path = jsonl(tmp_path / "steps.jsonl", [
        {"prompt": "p", "steps": ["a", "b\n", "c"], "labels": [True, 0, 1]},
        {"prompt": "p", "completion": "a\n\nb\n", "labels": [1, False]},
        {"prompt": "p", "completion": "one step", "labels": [True]},
    ])
    assert read_step_labels(path) == [
        StepLabelledSample("p", ("a\n", "b\n", "c"), (True, False, True)),
        StepLabelledSample("p", ("a\n\n", "b\n"), (True, False)),
        StepLabelledSample("p", ("one step",), (True,)),
    ]


def test_step_labels_custom_delimiter(tmp_path):
    path = jsonl(tmp_path / "steps.jsonl", [{"prompt": "p", "completion": "x<step>y", "labels": [1, 0]},
                                           {"prompt": "p", "steps": ["x", "y"], "labels": [1, 0]}])
    samples = read_step_labels(path, delimiter="<step>")
    assert [s.steps for s in samples] == [("x<step>", "y")] * 2


def test_step_label_count_mismatch_message(tmp_path):
    path = jsonl(tmp_path / "steps.jsonl", [{"prompt": "p", "completion": "a\nb", "labels": [1, 1]},
                                           {"prompt": "p", "completion": "a\nb", "labels": [1, 0, 1]}])
    with pytest.raises(DatasetError) as err:
        read_step_labels(path)
    assert str(err.value).startswith(f"{path}:2: 3 labels for 2 steps (split on '\\n')")


@pytest.mark.parametrize("bad, words", [
    ({"prompt": "p", "completion": "", "labels": []}, "0 labels for 1 steps"),
    ({"prompt": "p", "completion": "a", "labels": ["yes"]}, "'labels' item 0"),
    ({"prompt": "p", "completion": "a", "labels": 1}, "'labels' must be a list"),
    ({"prompt": "p", "completion": "a"}, "no field 'labels'"),
    ({"prompt": "p", "labels": [1]}, "no field 'steps'"),
    ({"prompt": "p", "steps": [], "labels": []}, "'steps' must be a non-empty list"),
    ({"prompt": "p", "steps": ["a", 3], "labels": [1, 1]}, "'steps' item 1"),
    ({"prompt": "p", "steps": ["a", "b"], "labels": [1]}, "1 labels for 2 steps;"),
])
def test_step_label_errors(tmp_path, bad, words):
    """Each malformed row names its line and what is wrong."""
    good = {"prompt": "p", "completion": "a", "labels": [1]}
    path = jsonl(tmp_path / "steps.jsonl", [good, good, bad])
    with pytest.raises(DatasetError) as err:
        read_step_labels(path)
    assert str(err.value).startswith(f"{path}:3: ") and words in str(err.value)
    assert len(read_step_labels(path, skip_malformed=True)) == 2


def test_step_labels_empty_delimiter(tmp_path):
    with pytest.raises(ValueError):
        read_step_labels(tmp_path / "missing.jsonl", delimiter="")


# --- split_steps --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, delimiter, steps", [
    ("a\nb", "\n", ["a\n", "b"]),
    ("a\nb\n", "\n", ["a\n", "b\n"]),
    ("a\n\nb", "\n", ["a\n\n", "b"]),
    ("a\n \n\tb\nc", "\n", ["a\n \n", "\tb\n", "c"]),
    ("no delimiter", "\n", ["no delimiter"]),
    ("\n\n a\nb", "\n", ["\n\n a\n", "b"]),
    ("a\n\nb\nc\n\nd", "\n\n", ["a\n\n", "b\nc\n\n", "d"]),
    ("a\n\n\n\nb", "\n\n", ["a\n\n\n\n", "b"]),
    ("x<step>y<step><step>z<step>", "<step>", ["x<step>", "y<step><step>", "z<step>"]),
    ("<step>x<step>y", "<step>", ["<step>x<step>", "y"]),
    ("  \n\n", "\n", ["  \n\n"]),
    ("", "\n", []),
])
def test_split_steps(text, delimiter, steps):
    assert split_steps(text, delimiter) == steps


def test_split_steps_empty_delimiter():
    with pytest.raises(ValueError):
        split_steps("a", "")


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab \n<>s", max_size=40), delimiter=st.sampled_from(["\n", "\n\n", "<s>", "a", "aa"]))
def test_split_steps_round_trips(text, delimiter):
    steps = split_steps(text, delimiter)
    assert "".join(steps) == text
    assert all(step.endswith(delimiter) for step in steps[:-1])
    assert all(steps) and (len(steps) > 0) == (len(text) > 0)
    assert len(steps) <= text.count(delimiter) + 1


# --- write_jsonl --------------------------------------------------------------------------------

def test_write_jsonl_round_trip_and_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    write_jsonl(path, [PAIR, {"prompt": "π", "chosen": "√", "rejected": "x"}])
    text = path.read_text(encoding="utf-8")
    assert "π" in text and text.count("\n") == 2
    assert read_preference_pairs(path)[1] == PreferencePair("π", "√", "x")
    assert os.listdir(tmp_path) == ["out.jsonl"]  # no temp file left behind
    with pytest.raises(TypeError):
        write_jsonl(path, [{"bad": object()}])
    with pytest.raises(TypeError):
        write_jsonl(path, ["not a dict"])
    assert path.read_text(encoding="utf-8") == text and os.listdir(tmp_path) == ["out.jsonl"]


def test_an_empty_completion_is_a_sample_not_an_error(tmp_path):
    """A policy that stops at once wrote an empty completion: it is a (wrong) sample to learn from,
    and the files grpokit writes with one read back."""
    pairs = jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "A: 2", "rejected": ""}])
    assert read_preference_pairs(pairs) == [PreferencePair("p", "A: 2", "")]
    steps = jsonl(tmp_path / "steps.jsonl", [{"prompt": "p", "completion": "", "labels": [0]},
                                            {"prompt": "p", "steps": [""], "labels": [0]}])
    assert [s.steps for s in read_step_labels(steps)] == [("",), ("",)]
