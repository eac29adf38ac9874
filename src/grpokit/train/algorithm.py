"""What an RL algorithm is to the training loop: advantages, a loss, and optionally a model of its
own. The loop (train/loop.py) owns everything else (rollouts, rewards, log-probs, forward,
backward, optimizer steps, checkpoints), so an algorithm never holds the trainer.

GRPO (train/grpo.py) is group-relative advantages and the clipped objective with the KL in the
loss; PPO (train/ppo.py) is GAE over KL-shaped token rewards with a critic of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpokit.config import GRPOConfig, RolloutConfig
from grpokit.math import GRPOObjective
from grpokit.micro_batches import RowLayout
from grpokit.rewards import RewardResult
from grpokit.types import Rollout


@dataclass
class Batch:
    """One step's samples as the loop hands them to the algorithm, on the policy's device."""

    rollout: Rollout
    result: RewardResult  # on the CPU, as the rewards made it
    loss_mask: torch.Tensor  # [N, T]: policy-sampled completion tokens (Rollout.policy_mask) of samples whose reward is valid
    ref_logp: torch.Tensor | None  # [N, T] under pi_ref, when the algorithm uses it
    old_logp: torch.Tensor | None  # [N, T] under pi_old, when the algorithm asks for it (else logp.detach())
    tokenizer: object
    rule_rewards: bool  # outcome rewards configured (False: step scores alone, a process reward model's or function's)
    extras: dict = field(default_factory=dict)  # what advantages() leaves for update_own_model()
    layout: RowLayout = field(default_factory=RowLayout)  # packed or padded forwards (grpo.pack_rows)


# Trainer.update(target: train/update.py's Optimized, batch, micro_loss, token_weighted) -> (sums, skipped)
Update = Callable[..., tuple[dict, int]]


class Algorithm:
    """The pieces of a learning step that differ between algorithms. The loop calls, each step:
    advantages(batch) -> loss(...) on every micro-batch of its policy update -> update_own_model."""

    name = ""

    def setup(self, policy: torch.nn.Module, config: GRPOConfig, rollout_config: RolloutConfig) -> None:
        """Called once by the loop before the first step (PPO builds its critic here); the run's loss
        is made here, its registered pieces looked up once."""
        self.config, self.rollout_config = config, rollout_config
        self.correction = rollout_config.off_policy_correction()  # tis for an older policy's batches unless named
        self.objective = GRPOObjective(
            clip_eps=config.epsilon, beta=self.loss_beta, clip_eps_high=config.epsilon_high,
            aggregation=config.loss_aggregation, max_completion_length=config.max_completion_length,
            importance_level=config.importance_sampling_level, policy_loss=config.loss, loss_args=config.loss_args,
            is_correction=self.correction, is_args=rollout_config.correction_args())

    @property
    def loss_beta(self) -> float:
        """The KL coefficient in the loss (GRPO: grpo.beta; PPO: 0, its KL is in the reward)."""
        return self.config.beta

    def wants_reference(self) -> bool:
        return self.config.beta > 0

    def wants_old_logprobs(self) -> bool:
        """pi_old's log-probs before the update; without them pi_old = pi_theta exactly (one update
        on one minibatch), and the loop uses logp.detach()."""
        return self.config.num_iterations > 1 or self.config.num_minibatches > 1

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """([N] or [N, T] advantages on the policy's device, metrics of this step)."""
        raise NotImplementedError

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
             advantages: torch.Tensor, mask: torch.Tensor, total: float | None,
             sampling_logp: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro-batch over the minibatch's count `total`: the run's GRPOObjective
        (math/losses.py; the configured loss, aggregation, importance level and correction)."""
        corrected = self.correction is not None and sampling_logp is not None
        return self.objective(logp, old_logp, ref_logp, advantages, mask, sampling_logp if corrected else None, total)

    def update_own_model(self, batch: Batch, update: Update) -> dict:
        """Train any model of the algorithm's own after the policy's update (PPO's critic)."""
        return {}

    # checkpoint hooks for a model and optimizer of the algorithm's own
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def before_save(self) -> None:
        """Gather what save_files writes (every process calls it)."""

    def save_files(self, directory: Path) -> None:
        pass

    def load_files(self, directory: Path) -> None:
        pass
