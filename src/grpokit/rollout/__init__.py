"""Turning prompts into groups of completions with their per-token log-probs."""

from grpokit.rollout.logprobs import position_ids_for, token_logprobs
from grpokit.rollout.sampler import SamplingParams, sample_groups

__all__ = ["SamplingParams", "position_ids_for", "sample_groups", "token_logprobs"]
