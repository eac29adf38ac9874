"""GRPO (DeepSeekMath eq. 3-6; docs/algorithm.md), the algorithm the training loop composes.

GRPO is its advantages: group-relative (eq. 5, or eq. 6 from a process reward model's step
scores); its loss is Algorithm's, the clipped objective with the k3 KL to a frozen pi_ref
(eq. 3-4). The loop (train/loop.py) runs the step: rollout -> rewards -> advantages -> mu
updates of the loss. pi_old is theta at sampling time; with mu = 1 its log-probs are logp.detach().
"""

from __future__ import annotations

import torch

from grpokit.config import GRPOConfig
from grpokit.math import process_advantages
from grpokit.math.registry import advantage as registered_advantage
from grpokit.math.registry import process_advantage as registered_process_advantage
from grpokit.rewards import RewardResult, WeightedReward
from grpokit.rewards.learned import ProcessRewardModel, policy_step_ends
from grpokit.train.algorithm import Algorithm, Batch
from grpokit.train.loop import Trainer

__all__ = ["GRPO", "GRPOTrainer", "process_metrics", "step_advantages"]


def step_advantages(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor, step_scores: list,
                    group_size: int, valid: torch.Tensor | None = None, estimator=process_advantages) -> torch.Tensor:
    """Process advantages (eq. 6, or the `estimator` grpo.process_advantage names) on the policy's sampled
    tokens: each StepScores' character step ends are mapped onto completion_ids [N, T] (see
    policy_step_ends), then normalised over the group's steps and summed over the steps at or after each
    token. A sample that is not `valid` (its reward failed; its StepScores may be None) has no steps: it
    takes no part in its group's statistics and gets 0. Returns [N, T] float32 on CPU."""
    lengths = [int(n) for n in lengths]
    keep = [bool(ok) and n > 0 and s is not None
            for ok, n, s in zip(valid if valid is not None else [True] * len(lengths), lengths, step_scores)]
    ends = [policy_step_ends(tokenizer, completion_ids[i, :n].tolist(), s.char_ends) if k else []
            for i, (k, n, s) in enumerate(zip(keep, lengths, step_scores))]
    rewards = [torch.tensor(s.rewards if k else [], dtype=torch.float64) for k, s in zip(keep, step_scores)]
    token_adv = estimator(rewards, ends, lengths, group_size).float()
    return torch.nn.functional.pad(token_adv, (0, completion_ids.shape[1] - token_adv.shape[1]))


class GRPO(Algorithm):
    """Group-relative advantages (eq. 5, or eq. 6 from a process reward model's step scores) and the
    clipped objective with the k3 KL to pi_ref in the loss (eq. 3-4): Algorithm's own loss."""

    name = "grpo"

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """[N] outcome advantages (grpo.advantage, eq. 5 by default) of the summed rewards; with step
        scores (a process reward model's or a process reward function's), [N, T] process advantages
        (grpo.process_advantage, eq. 6 by default), plus the outcome advantages of any outcome rewards
        configured beside them."""
        cfg, result, rollout = self.config, batch.result, batch.rollout
        estimator = registered_advantage(cfg.advantage).function
        outcome = estimator(result.total.float(), result.valid, cfg.num_generations, cfg.scale_rewards)
        if result.step_scores is None:
            return outcome.to(batch.loss_mask.device), {}
        token_adv = step_advantages(batch.tokenizer, rollout.completion_ids.cpu(), rollout.completion_lengths.cpu(),
                                    result.step_scores, cfg.num_generations, result.valid.cpu(),
                                    registered_process_advantage(cfg.process_advantage).function)
        advantages = token_adv + outcome.unsqueeze(1) if batch.rule_rewards else token_adv
        return advantages.to(batch.loss_mask.device), process_metrics(result)


def process_metrics(result: RewardResult) -> dict:
    """Steps per completion, mean step reward and completions without a step delimiter, over the scored ones."""
    scored = [s for s in result.step_scores if s is not None]
    steps = [len(s.rewards) for s in scored]
    flat = [r for s in scored for r in s.rewards]
    return {
        "process/steps_mean": sum(steps) / max(1, len(steps)),
        "process/step_reward_mean": sum(flat) / max(1, len(flat)),
        "process/no_delimiter": sum(not s.has_delimiter for s in scored),
    }


class GRPOTrainer(Trainer):
    """The training loop with GRPO as its algorithm."""

    def __init__(self, model, tokenizer, rewards: list[WeightedReward], dataset: list[dict], config: GRPOConfig,
                 run_dir, process_reward: ProcessRewardModel | None = None, **kwargs):
        super().__init__(model, tokenizer, rewards, dataset, config, run_dir, GRPO(), process_reward=process_reward,
                         **kwargs)
