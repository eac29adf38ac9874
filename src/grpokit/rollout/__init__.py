"""Turning prompts into groups of completions with their per-token log-probs."""

from grpokit.rollout.engine import HFEngine, RolloutEngine, make_engine, max_model_len, request_seeds
from grpokit.rollout.logprobs import position_ids_for, token_logprobs
from grpokit.rollout.sampler import SamplingParams, sample_groups

__all__ = ["HFEngine", "RolloutEngine", "SamplingParams", "make_engine", "max_model_len", "position_ids_for", "request_seeds",
           "sample_groups", "token_logprobs"]
