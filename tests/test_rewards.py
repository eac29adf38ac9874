"""Reward contract: TRL-style signature, weights, and failures that are masked, never zeroed."""

import math

import pytest
import torch

from grpokit.data import arithmetic
from grpokit.rewards import WeightedReward, get_reward_function, score_completions


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("7+5=12\nA: 12", "12", 1.0),
        ("7+5=12\nA: 13", "12", 0.0),
        ("7+5=12\n", "12", 0.0),  # no answer line
        ("A: 12\nA: 13", "12", 0.0),  # several different answers never score
        ("A: 12\nA: 12", "12", 1.0),  # the same answer twice is one answer
        ("A: -3", "-3", 1.0),
        ("A: 123", "12", 0.0),
    ],
)
def test_chain_accuracy_table(completion, answer, expected):
    assert arithmetic.chain_accuracy(["q"], [completion], answer=[answer]) == [expected]


def test_weights_and_per_function_scores():
    double = WeightedReward("acc", arithmetic.chain_accuracy, 2.0)
    length = WeightedReward("short", lambda prompts, completions, **_: [-len(c) / 10 for c in completions], 0.5)
    res = score_completions([double, length], ["p", "p"], ["A: 1", "A: 22"], {"answer": ["1", "1"]})
    assert res.total.tolist() == pytest.approx([2.0 - 0.5 * 0.4, 0.0 - 0.5 * 0.5])
    assert res.valid.all()
    assert res.function_means() == pytest.approx({"acc": 0.5, "short": -0.45})


def test_raising_function_fails_every_sample_but_does_not_raise():
    def broken(prompts, completions, **_):
        raise RuntimeError("verifier crashed")

    with pytest.warns(UserWarning, match="verifier crashed"):
        res = score_completions([WeightedReward("broken", broken)], ["p"] * 3, ["a", "b", "c"], {})
    assert not res.valid.any()
    assert torch.isnan(res.total).all()
    assert res.all_failed() == ["broken"]
    assert "verifier crashed" in res.errors["broken"]


def test_none_and_nan_fail_only_their_samples():
    def partial(prompts, completions, **_):
        return [1.0, None, float("nan"), 0.0]

    res = score_completions([WeightedReward("partial", partial)], ["p"] * 4, list("abcd"), {})
    assert res.valid.tolist() == [True, False, False, True]
    assert res.total[0] == 1.0 and res.total[3] == 0.0  # a failure is never a silent 0
    assert math.isnan(res.total[1]) and math.isnan(res.total[2])
    assert res.all_failed() == []


def test_wrong_length_is_a_failure_with_a_message():
    with pytest.warns(UserWarning):
        res = score_completions([WeightedReward("short", lambda prompts, completions, **_: [1.0])],
                                ["p", "p"], ["a", "b"], {})
    assert "returned 1 scores for 2 completions" in res.errors["short"]


def test_registry_by_name_and_import_path():
    assert get_reward_function("chain_accuracy") is arithmetic.chain_accuracy
    assert get_reward_function("grpokit.data.arithmetic:chain_accuracy") is arithmetic.chain_accuracy
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        get_reward_function("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        get_reward_function("no_such_module:fn")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        get_reward_function("grpokit.data.arithmetic:missing")
