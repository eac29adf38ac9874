"""PPO as DeepSeekMath describes it (SPEC.md eq. 1-2): the baseline GRPO removes.

Same rollout, rewards, checkpointing and loop as GRPO (it subclasses GRPOTrainer); only the
learning part differs:
  per-token reward  r_t = -beta (log pi_old - log pi_ref)  (+ the scalar reward at the last token)
  advantages        GAE(gamma, lambda) over r_t and the critic's values V(s_t)
  policy            the clipped surrogate, per-output mean (no KL term: it is in the reward)
  critic            a policy-sized value model with its own optimizer, clipped value loss
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from grpokit.config import GRPOConfig, PPOConfig
from grpokit.math import gae_advantages, kl_k3, value_loss
from grpokit.models.value import build_critic, token_values
from grpokit.rewards import RewardResult
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.types import Rollout

CRITIC_DIR = "critic"


def shaped_token_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                         mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's per-token reward (SPEC eq. 2): -beta (logp_old - logp_ref) on every completion token,
    plus the outcome reward on the last one. scores: [N]; the rest [N, T]. Zero outside the mask."""
    m = mask.to(old_logp.dtype)
    kl_penalty = -beta * (old_logp - ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
    rewards = kl_penalty * m
    last = (m.sum(dim=1).long() - 1).clamp(min=0)
    has_tokens = m.sum(dim=1) > 0
    bonus = torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; zero outside the mask."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = ((x - mean).pow(2) * m).sum() / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * m


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1 = perfect critic)."""
    m = mask.bool()
    r, v = returns[m], values[m]
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1 - (r - v).var() / r.var())


class PPOTrainer(GRPOTrainer):
    """GRPOTrainer's loop with PPO's learning step and a critic."""

    def __init__(self, *args, ppo: PPOConfig | None = None, critic: torch.nn.Module | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.ppo = ppo or PPOConfig()
        cfg: GRPOConfig = self.config
        # PPO needs pi_ref whenever beta > 0 (the KL is in the reward), exactly like GRPO.
        self.critic = critic if critic is not None else build_critic(self.model, self.ppo.critic_init)
        self.critic.eval()  # no dropout in value estimates; gradients flow all the same
        self.critic_optimizer = make_optimizer(self.critic, self.ppo.critic_learning_rate, cfg.weight_decay)
        self.critic_scheduler = warmup_constant(self.critic_optimizer, cfg.warmup_steps)

    def learn(self, rollout: Rollout, result: RewardResult, loss_mask: torch.Tensor, timings: dict) -> dict:
        cfg, ppo = self.config, self.ppo
        t = time.perf_counter()
        ref_logp, old_logp = self._fixed_logprobs(rollout, need_old=True)
        with torch.no_grad():
            old_values = token_values(self.critic, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                      cfg.micro_batch_size)
        timings["perf/logprob_time_s"] = time.perf_counter() - t

        scores = torch.where(result.valid, result.total, torch.zeros_like(result.total)).float()
        rewards = shaped_token_rewards(scores, old_logp, ref_logp, loss_mask, cfg.beta)
        advantages, returns = gae_advantages(rewards, old_values * loss_mask, loss_mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, loss_mask)

        t = time.perf_counter()
        stats = self._update(rollout, advantages, loss_mask, None, old_logp, beta=0.0)
        stats.update(self._update_critic(rollout, old_values, returns, loss_mask))
        timings["perf/update_time_s"] = time.perf_counter() - t
        if ref_logp is not None:  # report the same KL estimate GRPO reports, for comparison
            m = loss_mask.float()
            stats["kl"] = float((kl_k3(old_logp, ref_logp) * m).sum() / m.sum().clamp(min=1))
        stats["value/explained_variance"] = explained_variance(old_values, returns, loss_mask)
        stats["value/mean"] = float((old_values * loss_mask).sum() / loss_mask.sum().clamp(min=1))
        return stats

    def _update_critic(self, rollout: Rollout, old_values, returns, loss_mask) -> dict:
        cfg, ppo = self.config, self.ppo
        losses, clipped, tokens = 0.0, 0.0, 0.0
        for _ in range(cfg.num_iterations):
            for minibatch in torch.randperm(rollout.num_samples).chunk(cfg.num_minibatches):
                total = float(loss_mask[minibatch].sum())
                if total == 0:
                    continue
                self.critic_optimizer.zero_grad(set_to_none=True)
                for micro in minibatch.split(cfg.micro_batch_size):
                    mask = loss_mask[micro]
                    values = token_values(self.critic, rollout.input_ids[micro], rollout.attention_mask[micro],
                                          rollout.prompt_length, len(micro))
                    loss = value_loss(values, old_values[micro], returns[micro], mask, ppo.value_clip)
                    n = float(mask.sum())
                    (loss * (n / total)).backward()  # token means -> the minibatch's token mean
                    with torch.no_grad():
                        plain = (values - returns[micro]).pow(2)
                        clip_v = old_values[micro] + (values - old_values[micro]).clamp(-ppo.value_clip, ppo.value_clip)
                        clipped += float((((clip_v - returns[micro]).pow(2) > plain) * mask).sum())
                    losses += float(loss.detach()) * n
                    tokens += n
                norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                if torch.isfinite(norm):
                    self.critic_optimizer.step()
                    self.critic_scheduler.step()
                else:
                    self.critic_optimizer.zero_grad(set_to_none=True)
        return {"value/loss": losses / tokens if tokens else 0.0,
                "value/clip_fraction": clipped / tokens if tokens else 0.0}

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["critic_optimizer"] = self.critic_optimizer.state_dict()
        state["critic_scheduler"] = self.critic_scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.critic_scheduler.load_state_dict(state["critic_scheduler"])

    def _write_extra_files(self, directory: Path) -> None:
        self.critic.save_pretrained(directory / CRITIC_DIR, safe_serialization=True)
        super()._write_extra_files(directory)

    def resume_from(self, checkpoint: str | Path) -> None:
        from safetensors.torch import load_file

        weights = Path(checkpoint) / CRITIC_DIR / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{checkpoint} has no {CRITIC_DIR}/ weights: it was not written by a PPO run")
        self.critic.load_state_dict(load_file(weights))
        super().resume_from(checkpoint)
