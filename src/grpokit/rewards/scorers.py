"""The scorer for a saved reward model, by its kind and head: an outcome or a score-head process reward
model (learned.py), or a likelihood process reward model (likelihood_prm.py). Kept apart from both, so
neither imports the other's dispatch."""

from __future__ import annotations

from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel, RewardModelInfo
from grpokit.rewards.likelihood_prm import LikelihoodProcessRewardModel


def as_scorer(model, tokenizer, info: RewardModelInfo, batch_size: int = 64):
    """The scorer object for a loaded reward model."""
    if info.head == "likelihood":
        return LikelihoodProcessRewardModel(model, tokenizer, info.step_delimiter, batch_size, info.weight, info.bias)
    if info.kind == "process":
        return ProcessRewardModel(model, tokenizer, info.step_delimiter, batch_size)
    return OutcomeRewardModel(model, tokenizer, batch_size)


def scorer_info(scorer, step_delimiter: str) -> RewardModelInfo:
    """What to save beside a scorer's weights."""
    if isinstance(scorer, LikelihoodProcessRewardModel):
        return RewardModelInfo("process", step_delimiter, "likelihood", scorer.weight, scorer.bias)
    return RewardModelInfo(scorer.kind, step_delimiter)
