"""Turning prompts into groups of completions with their per-token log-probs."""

from grpokit.rollout.engine import (HFEngine, RolloutEngine, longest_prompt_tokens, make_engine, max_model_len,
                                   request_seeds, run_max_model_len, WeightSyncError)
from grpokit.rollout.logprobs import position_ids_for, token_logprobs
from grpokit.rollout.sampler import SamplingParams, sample_groups

__all__ = ["HFEngine", "RolloutEngine", "SamplingParams", "longest_prompt_tokens", "make_engine", "max_model_len",
           "position_ids_for", "request_seeds", "run_max_model_len", "sample_groups", "token_logprobs",
           "WeightSyncError"]
