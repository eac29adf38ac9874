"""The rollout-engine seam: everything that samples (GRPO, PPO, reward-model data, evaluation)
asks a RolloutEngine for groups of completions, and the trainer syncs it after each update.

`hf` samples with transformers' `generate` on the live policy; `vllm` (rollout/vllm.py) is a
colocated vLLM engine that receives the policy's weights after every optimizer step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from grpokit.seeds import derive_seed
from grpokit.errors import ConfigError
from grpokit.rollout.registry import engine_spec, register_engine
from grpokit.rollout.sampler import (Continuation, SamplingParams, continue_ids, note_ignored_sampling_defaults,
                                    sample_groups)
from grpokit.types import Rollout


class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams,
                 rows: list[dict] | None = None, seeds: list[int] | None = None) -> Rollout:
        """G completions per prompt, groups contiguous; `seeds` holds one per completion.
        A completion ends after the first of `params.stop` it writes, the stop string kept."""

    copies_weights: bool  # holds its own copy of the weights, so each update must be pushed to it

    # Optional: continue_ids(contexts, budgets, params, seeds) -> list[Continuation], one continuation
    # of each token-id context, which multi-turn tool rollouts need (rollout/multi_turn.py).

    def sync_weights(self, model: torch.nn.Module, state_dict: dict | None = None) -> None:
        """Load `model`'s current weights (or `state_dict`, named as in `model`) into the engine."""

    def release_memory(self, weights_pushed_next: bool) -> None:
        """Free what the engine can until its next call (`weights_pushed_next`: a sync comes first)."""

    def close(self) -> None:
        """Free everything the engine holds; it is not used again."""


class WeightSyncError(RuntimeError):
    """The engine does not hold the weights just pushed to it (its sync probe disagrees)."""


class RolloutEngineError(RuntimeError):
    """The rollout engine's own library raised while sampling; the message names the engine and
    the library's error in one line (the trainer adds the step and where to resume from)."""


class HFEngine:
    """transformers' generate on the policy itself: sampling always sees the current weights,
    so a sync only re-points the engine. Draws from torch's global RNG (per-request seeds are
    a vLLM feature; the run's seed fixes the whole sequence here)."""

    copies_weights = False

    def __init__(self, model: torch.nn.Module, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        note_ignored_sampling_defaults(model)  # where it is built directly too (training, evaluation)

    def generate(self, prompts, num_generations, params, rows=None, seeds=None) -> Rollout:
        return sample_groups(self.model, self.tokenizer, prompts, num_generations, params, rows)

    def continue_ids(self, contexts: list[list[int]], budgets: list[int], params: SamplingParams,
                     seeds: list[int] | None = None) -> list[Continuation]:
        """One continuation of each token-id context (multi-turn rollouts, rollout/multi_turn.py)."""
        return continue_ids(self.model, self.tokenizer, contexts, budgets, params)

    def sync_weights(self, model: torch.nn.Module, state_dict: dict | None = None) -> None:
        self.model = model

    def release_memory(self, weights_pushed_next: bool) -> None:
        """Nothing to free: the policy is the engine."""

    def close(self) -> None:
        """Nothing to free: the policy is the engine."""


def evaluation_engine(engine: RolloutEngine) -> RolloutEngine:
    """What evaluation samples with: the engine's own evaluation view where it keeps per-shape state that
    evaluation must not touch (hf_static's static caches), else the engine itself."""
    for_evaluation = getattr(engine, "for_evaluation", None)
    return for_evaluation() if for_evaluation is not None else engine


def request_seeds(seed: int, step: int, prompt_indices: list[int], num_generations: int) -> list[int]:
    """One seed per completion from (run seed, step, prompt index, sample index): a completion
    does not depend on which other prompts share its batch or its process."""
    return [derive_seed(seed, step, p, s) for p in prompt_indices for s in range(num_generations)]


def max_model_len(rollout_config, model: torch.nn.Module) -> int:
    """The longest prompt + completion an engine serves when the prompts are not known up front:
    rollout.max_model_len, else the model's max_position_embeddings (4096 when its config has none)."""
    return rollout_config.max_model_len or getattr(model.config, "max_position_embeddings", 4096)


def longest_prompt_tokens(tokenizer, prompts: list[str]) -> int:
    """The token count of the longest of `prompts` (0 for none), as the engines tokenize them."""
    if not prompts:
        return 0
    return max(len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"])


def run_max_model_len(rollout_config, needed: int, what: str) -> int:
    """rollout.max_model_len when set, else `needed` (the run's longest prompt + its room to write,
    described by `what`). An override shorter than `needed` is a config error: every request of the
    run must fit."""
    override = rollout_config.max_model_len
    if not override:
        return needed
    if override < needed:
        raise ConfigError(f"rollout.max_model_len={override} is shorter than {what} = {needed} tokens: raise it to "
                          f"at least {needed}, or set 0 to size it from the run's prompts")
    return override


def make_engine(rollout_config, model: torch.nn.Module, tokenizer, seed: int = 0,
                model_len: int | None = None, weights_dir: str | None = None) -> RolloutEngine:
    """The engine rollout.engine names (rollout/registry.py), built once from the policy.
    model_len: the longest prompt + completion an engine that copies the weights must serve
    (run_max_model_len); None = max_model_len(rollout_config, model). weights_dir: where the
    policy's weights lie unchanged, for such an engine to load without a copy."""
    spec = engine_spec(rollout_config.engine)
    note_ignored_sampling_defaults(model)  # every engine, a remote one too (each also says it when built directly)
    if spec.copies_weights:
        model_len = model_len or max_model_len(rollout_config, model)
    return spec.build(rollout_config, model, tokenizer, seed, model_len, weights_dir)


@register_engine("hf", copies_weights=False, runs_in_worker=True)
def _build_hf(rollout_config, model, tokenizer, seed, model_len, weights_dir) -> HFEngine:
    return HFEngine(model, tokenizer)
