"""Scoring completions. A reward function follows TRL's contract:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

`columns` are the dataset's fields, one list per field. None (or NaN) means "could not
score this sample": it is masked out of the loss and counted, never turned into 0.
"""

from grpokit.rewards.math_rewards import math_accuracy
from grpokit.rewards.registry import (
    RewardFunction,
    get_reward_function,
    register_reward,
)
from grpokit.rewards.scoring import RewardResult, WeightedReward, score_completions

__all__ = [
    "RewardFunction",
    "RewardResult",
    "WeightedReward",
    "get_reward_function",
    "math_accuracy",
    "register_reward",
    "score_completions",
]
