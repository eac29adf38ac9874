"""RLOO's leave-one-out advantage (`grpo.advantage: rloo`, math/rloo.py), worked by hand."""

import pytest
import torch

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.math.registry import advantage


def rloo(rewards, valid, group_size):
    return advantage("rloo").function(torch.tensor(rewards, dtype=torch.float64), torch.tensor(valid), group_size,
                                      False)


def test_by_hand():
    # one group [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    # groups of 2: [1, 0] -> 1, -1; [0, 1] -> -1, 1; [3, 1] -> 2, -2; [5, 7] -> -2, 2
    got = rloo([1, 0, 0, 1, 3, 1, 5, 7], [True] * 8, 2)
    assert got.tolist() == pytest.approx([1, -1, -1, 1, 2, -2, -2, 2], abs=1e-12)
    got = rloo([1, 0, 0, 1], [True] * 4, 4)
    assert got.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-12)


def test_an_invalid_sample_gets_zero_and_leaves_the_baseline():
    # valid 1, 0, 4 (the second sample's reward failed): A_0 = 1 - (0 + 4) / 2 = -1, A_2 = 0 - 2.5, A_3 = 4 - 0.5
    got = rloo([1, 99, 0, 4], [True, False, True, True], 4)
    assert got.tolist() == pytest.approx([-1.0, 0.0, -2.5, 3.5], abs=1e-12)
    assert rloo([1, 5], [True, False], 2).tolist() == [0.0, 0.0]  # fewer than 2 valid: nothing to compare


def test_matches_its_definition_on_random_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    got = advantage("rloo").function(rewards, torch.ones(24, dtype=torch.bool), 6, True)
    for i in range(24):
        group = rewards[i // 6 * 6 : i // 6 * 6 + 6].tolist()
        others = group[:i % 6] + group[i % 6 + 1 :]
        assert got[i].item() == pytest.approx(rewards[i].item() - sum(others) / 5, abs=1e-12)


def test_the_config_names_it():
    assert load_config(overrides=["--grpo.advantage=rloo"]).grpo.advantage == "rloo"
    with pytest.raises(ConfigError, match=r"grpo.advantage: unknown advantage estimator 'rlo' \(did you mean 'rloo'\?\)"):
        load_config(overrides=["--grpo.advantage=rlo"])
