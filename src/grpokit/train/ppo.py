"""PPO as DeepSeekMath describes it (docs/algorithm.md, eq. 1-2): the baseline GRPO removes.

Same rollout, rewards, policy update, checkpointing and training loop as GRPO (train/loop.py);
only the advantages, the loss's KL and a model of its own differ:
  per-token reward  r_t = -beta (log pi_old - log pi_ref)  (+ the scalar reward at the last token)
  advantages        GAE(gamma, lambda) over r_t and the critic's values V(s_t)
  policy            the clipped surrogate, per-output mean (no KL term: it is in the reward)
  critic            a policy-sized value model with its own optimizer, clipped value loss
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from grpokit import distributed
from grpokit.config import GRPOConfig, PPOConfig
from grpokit.math import gae_advantages, kl_k3, value_loss
from grpokit.micro_batches import RowLayout, attended_ends
from grpokit.models.sharding import (full_state_dict, load_full_state_dict, load_optimizer_state, local_tensors,
                                     shard_model)
from grpokit.models.wrapping import is_sharded
from grpokit.models.value import build_critic, token_values
from grpokit.train.algorithm import Algorithm, Batch, Update
from grpokit.train.loop import Trainer
from grpokit.train.packing import same_attention
from grpokit.train.schedule import make_optimizer, warmup_constant
from grpokit.train.update import Optimized
from grpokit.types import Rollout

CRITIC_DIR = "critic"


def shaped_token_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                         mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's per-token reward (docs/algorithm.md, eq. 2): -beta (logp_old - logp_ref) on every completion token,
    plus the outcome reward on the last one. scores: [N]; the rest [N, T]. Zero outside the mask, which
    may have holes (tool output between sampled tokens): the last token is the last one under it."""
    m = mask.to(old_logp.dtype)
    kl_penalty = -beta * (old_logp - ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
    rewards = kl_penalty * m
    last = (attended_ends(mask) - 1).clamp(min=0)
    has_tokens = m.sum(dim=1) > 0
    bonus = torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; zero outside the mask. Under torchrun the mean
    and std are those of every process's entries together, so the result does not depend on
    how the batch is split."""
    m = mask.to(x.dtype)
    n = distributed.all_reduce_sum(m.sum()).clamp(min=1)
    mean = distributed.all_reduce_sum((x * m).sum()) / n
    var = distributed.all_reduce_sum(((x - mean).pow(2) * m).sum()) / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * m


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens (1 = perfect critic)."""
    m = mask.bool()
    r, v = returns[m], values[m]
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1 - (r - v).var() / r.var())


class PPO(Algorithm):
    """PPO's learning step: a critic of its own, GAE over KL-shaped token rewards, the clipped
    surrogate without a KL term (it is in the reward)."""

    name = "ppo"

    def __init__(self, ppo: PPOConfig | None = None, critic: torch.nn.Module | None = None):
        self.ppo, self.critic = ppo or PPOConfig(), critic

    def setup(self, policy: torch.nn.Module, config: GRPOConfig, rollout_config) -> None:
        super().setup(policy, config, rollout_config)
        # PPO needs pi_ref whenever beta > 0 (the KL is in the reward), exactly like GRPO.
        if self.critic is None:
            self.critic = build_critic(policy, self.ppo.critic_init)
        if is_sharded(policy) and not is_sharded(self.critic):
            self.critic = shard_model(self.critic)  # the critic is sharded like the policy
        self._critic_state = None
        self._packs_like_policy = same_attention(self.critic, policy)  # so it packs when the policy does
        self.critic.eval()  # no dropout in value estimates; gradients flow all the same
        self.critic_optimizer = make_optimizer(self.critic, self.ppo.critic_learning_rate, config.weight_decay)
        self.critic_scheduler = warmup_constant(self.critic_optimizer, config.warmup_steps)

    @property
    def loss_beta(self) -> float:
        return 0.0  # the KL is in the token rewards

    def wants_old_logprobs(self) -> bool:
        return True  # the KL-shaped rewards use pi_old's log-probs

    def values(self, rollout: Rollout, rows=None, layout: RowLayout | None = None) -> torch.Tensor:
        """[n, T] critic values V(s_t) of the completion tokens, on the critic's device; packed as the
        step's `layout` packs the policy's rows when the critic is of the policy's kind."""
        rows = slice(None) if rows is None else rows
        layout = layout or RowLayout()
        if not self._packs_like_policy:
            layout = RowLayout(computed=layout.computed)
        return token_values(self.critic, rollout.input_ids[rows], rollout.attention_mask[rows],
                            rollout.prompt_length, self.config.micro_batch_size,
                            max_tokens=self.config.max_tokens_per_micro_batch,
                            budget_key="grpo.max_tokens_per_micro_batch", **layout.forward_options())

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        cfg, ppo, mask = self.config, self.ppo, batch.loss_mask
        device = mask.device
        with torch.no_grad():
            old_values = self.values(batch.rollout, layout=batch.layout).to(device)
        valid = batch.result.valid.to(device)
        scores = torch.where(valid, batch.result.total.to(device), 0.0).float()
        rewards = shaped_token_rewards(scores, batch.old_logp, batch.ref_logp, mask, cfg.beta)
        advantages, returns = gae_advantages(rewards, old_values * mask, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = whiten(advantages, mask)
        batch.extras.update(old_values=old_values, returns=returns)
        stats = {"value/explained_variance": explained_variance(old_values, returns, mask),
                 "value/mean": float((old_values * mask).sum() / mask.sum().clamp(min=1))}
        if batch.ref_logp is not None:  # report the same KL estimate GRPO reports, for comparison
            m = mask.float()
            stats["kl"] = float((kl_k3(batch.old_logp, batch.ref_logp) * m).sum() / m.sum().clamp(min=1))
        return advantages, stats

    def update_own_model(self, batch: Batch, update: Update) -> dict:
        """The critic's clipped value-loss updates, through the loop's update (token-weighted)."""
        sums, _ = update(Optimized(self.critic, self.critic_optimizer, self.critic_scheduler), batch,
                         self.critic_micro_loss(batch), token_weighted=True)
        self.critic.eval()
        tokens = sums.get("tokens", 0.0)
        return {"value/loss": sums["loss"] / max(1.0, sums.get("optimizer_steps", 0.0)),
                "value/clip_fraction": sums["clipped"] / tokens if tokens else 0.0}

    def critic_micro_loss(self, batch: Batch):
        """micro_loss(rows, epoch, total) for the loop's update: the clipped value loss, a token mean."""
        clip, loss_mask = self.ppo.value_clip, batch.loss_mask
        old_values, returns = batch.extras["old_values"], batch.extras["returns"]

        def micro_loss(micro: torch.Tensor, epoch: int, total: float | None = None):
            mask = loss_mask[micro]
            values = self.values(batch.rollout, micro, batch.layout).to(mask.device)
            tokens = mask.sum()
            # value_loss is this micro-batch's token mean; times its share of the minibatch's tokens
            loss = value_loss(values, old_values[micro], returns[micro], mask, clip) * (tokens / (total or tokens))
            with torch.no_grad():
                plain = (values - returns[micro]).pow(2)
                clip_v = old_values[micro] + (values - old_values[micro]).clamp(-clip, clip)
                clipped = (((clip_v - returns[micro]).pow(2) > plain) * mask).sum()
            return loss, {"loss": loss.detach(), "clipped": clipped, "tokens": tokens}

        return micro_loss

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"critic_optimizer": local_tensors(self.critic_optimizer.state_dict()),
                "critic_scheduler": self.critic_scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_optimizer_state(self.critic_optimizer, state["critic_optimizer"])
        self.critic_scheduler.load_state_dict(state["critic_scheduler"])

    def before_save(self) -> None:
        """Gather a sharded critic's weights (every process calls this; rank 0 keeps them)."""
        self._critic_state = full_state_dict(self.critic) if is_sharded(self.critic) else None

    def save_files(self, directory: Path) -> None:
        kwargs = {"state_dict": self._critic_state} if self._critic_state is not None else {}
        self.critic.save_pretrained(directory / CRITIC_DIR, safe_serialization=True, **kwargs)
        self._critic_state = None

    def load_files(self, directory: Path) -> None:
        weights = directory / CRITIC_DIR / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{directory} has no {CRITIC_DIR}/ weights: it was not written by a PPO run")
        load_full_state_dict(self.critic, load_file(weights))


class PPOTrainer(Trainer):
    """The training loop with PPO as its algorithm."""

    def __init__(self, model, tokenizer, rewards, dataset, config: GRPOConfig, run_dir, ppo: PPOConfig | None = None,
                 **kwargs):
        """kwargs: critic= (a critic of your own; default: built from the policy, ppo.critic_init) and
        the Trainer's options (train/loop.py, TrainerOptions)."""
        critic: torch.nn.Module | None = kwargs.pop("critic", None)
        super().__init__(model, tokenizer, rewards, dataset, config, run_dir, PPO(ppo, critic), **kwargs)

    @property
    def critic(self) -> torch.nn.Module:
        return self.algorithm.critic
