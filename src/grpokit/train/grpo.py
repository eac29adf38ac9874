"""GRPO (DeepSeekMath eq. 3-6; docs/algorithm.md), the algorithm the training loop composes.

Learning step: group-relative advantages (eq. 5, or eq. 6 from a process reward model's step
scores) -> mu updates of the clipped objective with the k3 KL to a frozen pi_ref in the loss
(eq. 3-4). pi_old is theta at sampling time; with mu = 1 its log-probs are logp.detach().
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from grpokit.config import GRPOConfig
from grpokit.math import grpo_loss, process_advantages
from grpokit.math.registry import advantage as registered_advantage
from grpokit.models.lora import as_module
from grpokit.rewards import RewardResult, WeightedReward
from grpokit.rewards.learned import ProcessRewardModel, policy_step_ends
from grpokit.rollout import token_logprobs
from grpokit.rollout.logprobs import attended_ends
from grpokit.train.loop import Algorithm, NonFiniteTraining, RewardFailure, Trainer, frozen_copy, zero_std_fraction
from grpokit.types import Rollout

__all__ = ["GRPO", "GRPOTrainer", "NonFiniteTraining", "RewardFailure", "frozen_copy", "policy_logprobs",
           "row_tokens", "step_advantages", "zero_std_fraction"]


def policy_logprobs(trainer: Trainer, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
    """[N, T] log-probs of the rollout's completions under `model` (no gradient), on the policy's device.
    `model` may be a LoRA policy's reference: the policy with its adapters disabled."""
    cfg = trainer.config
    with torch.no_grad(), as_module(model) as module:
        logp, _ = token_logprobs(module, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                 cfg.temperature, cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
                                 budget_key="grpo.max_tokens_per_micro_batch")
    return logp.to(trainer.device)


def policy_micro_loss(trainer: Trainer, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor,
                      ref_logp: torch.Tensor | None, old_logp: torch.Tensor | None, beta: float):
    """micro_loss(rows, epoch, total) for Trainer.update: the clipped surrogate (+ beta k3) of
    those rows over the minibatch's count `total`, in the configured aggregation, importance
    level and TIS correction, and the tensors the log sums. Every tensor lives on the policy's device."""
    cfg, rollout_cfg = trainer.config, trainer.rollout_config
    corrected = rollout_cfg.is_correction != "none" and rollout.sampling_logp is not None
    # rollout.is_cap is tis's own key, older than rollout.is_args
    is_cap = rollout_cfg.is_cap if corrected and rollout_cfg.is_correction == "tis" else None

    def micro_loss(micro: torch.Tensor, epoch: int, total: float | None = None):
        mask = loss_mask[micro]
        logp, entropy = token_logprobs(trainer.model, rollout.input_ids[micro], rollout.attention_mask[micro],
                                       rollout.prompt_length, cfg.temperature, len(micro), with_entropy=epoch == 0)
        loss, stats = grpo_loss(
            logp, old_logp[micro] if old_logp is not None else logp.detach(),
            ref_logp[micro] if ref_logp is not None else None, advantages[micro], mask,
            clip_eps=cfg.epsilon, beta=beta, clip_eps_high=cfg.epsilon_high, aggregation=cfg.loss_aggregation,
            max_completion_length=cfg.max_completion_length, importance_level=cfg.importance_sampling_level,
            sampling_logp=rollout.sampling_logp[micro] if corrected else None, is_cap=is_cap,
            denominator=total, policy_loss=cfg.loss, loss_args=cfg.loss_args,
            is_correction=rollout_cfg.is_correction if corrected else None, is_args=rollout_cfg.is_args)
        tokens = stats["tokens"]
        sums = {key: stats[key] * tokens for key in ("kl", "clip_fraction", "ratio_mean", "policy_loss")}
        sums.update(loss=loss.detach(), tokens=tokens)
        if rollout.sampling_logp is not None:  # how far the engine's log-probs are from the trainer's pi_old
            old = (old_logp[micro] if old_logp is not None else logp.detach()).to(rollout.sampling_logp.dtype)
            sums["rollout/logp_mismatch"] = ((old - rollout.sampling_logp[micro]).abs() * mask).sum()
        if corrected:  # the correction's own shares: tis is_capped_frac, icepop is_dropped_frac, ...
            sums.update({f"rollout/{k}": v * tokens for k, v in stats.items() if k.startswith("is_")})
        if entropy is not None:
            cm = rollout.completion_mask[micro].to(entropy.dtype)
            sums.update(entropy_sum=(entropy * cm).sum(), entropy_tokens=cm.sum())
        return loss, sums

    return micro_loss


def row_tokens(rollout: Rollout) -> torch.Tensor:
    """[N] tokens each row's forward computes: its prompt columns and its completion up to the
    last attended token (token_logprobs cuts a micro-batch to its longest row the same way)."""
    return attended_ends(rollout.attention_mask).clamp(min=rollout.prompt_length + 1)


def update_policy(trainer: Trainer, rollout: Rollout, advantages, loss_mask, ref_logp, old_logp, beta: float) -> dict:
    """mu epochs of clipped policy updates through the shared loop; the step's policy metrics."""
    sums, skipped = trainer.update(trainer.model, trainer.optimizer, trainer.scheduler, loss_mask,
                                   policy_micro_loss(trainer, rollout, advantages, loss_mask, ref_logp, old_logp, beta),
                                   row_lengths=row_tokens(rollout))
    tokens, steps = sums.get("tokens", 0.0), sums.get("optimizer_steps", 0.0)
    out = {k: sums[k] / tokens for k in ("kl", "clip_fraction", "ratio_mean", "policy_loss") if k in sums} \
        if tokens else {"kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0}
    out["loss"] = sums.get("loss", 0.0) / max(1.0, steps)  # the mean over optimizer steps of each one's loss
    out.update({k: v / tokens for k, v in sums.items() if k.startswith("rollout/") and tokens})
    out["entropy"] = sums["entropy_sum"] / sums["entropy_tokens"] if sums.get("entropy_tokens") else float("nan")
    out["grad_norm"] = sums["grad_norm_sum"] / sums["optimizer_steps"] if sums.get("optimizer_steps") else 0.0
    out["skipped_updates"] = skipped
    return out


def step_advantages(tokenizer, completion_ids: torch.Tensor, lengths: torch.Tensor, step_scores: list,
                    group_size: int) -> torch.Tensor:
    """Process advantages (eq. 6) on the policy's sampled tokens: each StepScores' character step
    ends are mapped onto completion_ids [N, T] (see policy_step_ends), then normalised over the
    group's steps and summed over the steps at or after each token. Returns [N, T] float32 on CPU."""
    lengths = [int(n) for n in lengths]
    ends = [policy_step_ends(tokenizer, completion_ids[i, :n].tolist(), s.char_ends) if n else []
            for i, (n, s) in enumerate(zip(lengths, step_scores))]
    rewards = [s.rewards if n else [] for n, s in zip(lengths, step_scores)]
    token_adv = process_advantages(rewards, ends, lengths, group_size).float()
    return torch.nn.functional.pad(token_adv, (0, completion_ids.shape[1] - token_adv.shape[1]))


class GRPO(Algorithm):
    """Group-relative advantages and the clipped objective with the KL in the loss."""

    name = "grpo"

    def __init__(self, process_reward: ProcessRewardModel | None = None):
        self.process_reward = process_reward  # set: process supervision (eq. 6) from its step scores

    def learn(self, trainer: Trainer, rollout: Rollout, result: RewardResult, loss_mask: torch.Tensor,
              timings: dict) -> dict:
        t = time.perf_counter()
        if self.process_reward is not None:
            result.step_scores = self.process_reward.score_steps(rollout.prompts, rollout.completions)
            if not self.trainer.rewards:  # for the log and progress bar only: each completion's mean step score
                result.total = torch.tensor([sum(s.rewards) / len(s.rewards) for s in result.step_scores],
                                            dtype=torch.float64)
        timings["perf/scoring_time_s"] += time.perf_counter() - t
        advantages = self.advantages(rollout, result).to(trainer.device)
        t = time.perf_counter()
        ref_logp, old_logp = self.fixed_logprobs(trainer, rollout)
        timings["perf/logprob_time_s"] = time.perf_counter() - t
        t = time.perf_counter()
        stats = update_policy(trainer, rollout, advantages, loss_mask, ref_logp, old_logp, self.config.beta)
        timings["perf/update_time_s"] = time.perf_counter() - t
        return {**self._process_metrics(result), **stats}

    def advantages(self, rollout: Rollout, result: RewardResult) -> torch.Tensor:
        """[N] outcome advantages (eq. 5) of the summed rewards; with a process reward model,
        [N, T] process advantages (eq. 6) of its step scores, plus the outcome advantages of
        any rule-based rewards configured beside it. On the rewards' device (the CPU)."""
        cfg = self.config
        estimator = registered_advantage(cfg.advantage).function
        outcome = estimator(result.total.float(), result.valid, cfg.num_generations, cfg.scale_rewards)
        if self.process_reward is None:
            return outcome
        token_adv = step_advantages(self.trainer.tokenizer, rollout.completion_ids.cpu(), rollout.completion_lengths.cpu(),
                                    result.step_scores, cfg.num_generations)
        return token_adv + outcome.unsqueeze(1) if self.trainer.rewards else token_adv

    def fixed_logprobs(self, trainer: Trainer, rollout: Rollout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference log-probs once per batch; pi_old log-probs only when samples are reused."""
        cfg = self.config
        ref_logp = policy_logprobs(trainer, trainer.ref_model, rollout) if cfg.beta > 0 else None
        # With one update on one minibatch, pi_old = pi_theta exactly: use logp.detach() instead.
        reuse = cfg.num_iterations > 1 or cfg.num_minibatches > 1
        return ref_logp, (policy_logprobs(trainer, trainer.model, rollout) if reuse else None)

    @staticmethod
    def _process_metrics(result: RewardResult) -> dict:
        if result.step_scores is None:
            return {}
        steps = [len(s.rewards) for s in result.step_scores]
        flat = [r for s in result.step_scores for r in s.rewards]
        return {
            "process/steps_mean": sum(steps) / max(1, len(steps)),
            "process/step_reward_mean": sum(flat) / max(1, len(flat)),
            "process/no_delimiter": sum(not s.has_delimiter for s in result.step_scores),
        }


class GRPOTrainer(Trainer):
    """The training loop with GRPO as its algorithm."""

    def __init__(self, model, tokenizer, rewards: list[WeightedReward], dataset: list[dict], config: GRPOConfig,
                 run_dir, process_reward: ProcessRewardModel | None = None, **kwargs):
        super().__init__(model, tokenizer, rewards, dataset, config, run_dir, GRPO(process_reward), **kwargs)
