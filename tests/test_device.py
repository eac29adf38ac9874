"""Device discipline without a GPU: the policy, reference and critic on the `meta` device.

PyTorch refuses to mix a CPU tensor with a meta one exactly as it refuses CPU with CUDA
("Tensor on device cpu is not on the expected device meta!"), and a meta model runs forward
and backward, so a learning step whose tensors do not all move to the model's device fails
here as it would on CUDA. Rollouts come back on the CPU, as an engine returns them."""

import copy

import pytest
import torch

from grpokit.config import GRPOConfig, PPOConfig
from grpokit.math import gae_advantages, grpo_loss, kl_k3, value_loss
from grpokit.rewards import WeightedReward
from grpokit.data import arithmetic
from grpokit.rollout import SamplingParams, sample_groups
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.ppo import PPOTrainer, shaped_token_rewards

META = torch.device("meta")


def on_meta(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    model.config._attn_implementation = "eager"  # sdpa's mask shortcut reads a value, which meta has not
    return model.to(META)


def cpu_rollout(model, tokenizer, rows, g=4):
    return sample_groups(model, tokenizer, [r["prompt"] for r in rows], g, SamplingParams(12, 1.0), rows)


def test_the_loss_functions_work_on_the_device_of_their_inputs():
    n, t = 4, 5
    logp, old, ref, sampling = (torch.randn(n, t, device=META) for _ in range(4))
    mask = torch.ones(n, t, device=META)
    for aggregation in ("sequence", "token", "constant"):
        for level in ("token", "sequence"):
            loss, stats = grpo_loss(logp, old, ref, torch.randn(n, device=META), mask, aggregation=aggregation,
                                    max_completion_length=t, importance_level=level, sampling_logp=sampling)
            assert loss.device == META and all(v.device == META for v in stats.values())
    assert kl_k3(logp, ref).device == META
    assert value_loss(logp, old, ref, mask).device == META
    adv, ret = gae_advantages(logp, old, mask, 1.0, 0.95)
    assert adv.device == META and ret.device == META
    with pytest.raises(RuntimeError, match="device"):  # the check this file relies on
        grpo_loss(logp, old, ref, torch.randn(n), mask)


def test_the_learning_half_of_a_grpo_step_keeps_every_tensor_on_the_policy_device(tiny_model, tokenizer,
                                                                                  chain_rows, tmp_path):
    config = GRPOConfig(num_generations=4, prompts_per_step=2, max_completion_length=12, num_iterations=2)
    rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy)]
    trainer = GRPOTrainer(tiny_model, tokenizer, rewards, chain_rows, config, tmp_path, progress=False)
    rollout = cpu_rollout(tiny_model, tokenizer, chain_rows[:2])
    result = trainer._score(rollout)
    trainer.model, trainer.ref_model, trainer.device = on_meta(tiny_model), on_meta(trainer.ref_model), META

    rollout, loss_mask = trainer.on_policy_device(rollout, result)  # what every step does
    ref_logp, old_logp = trainer.fixed_logprobs(rollout)  # what Trainer.step does
    batch = Batch(rollout, result, loss_mask, ref_logp, old_logp, tokenizer, True)
    advantages, _ = trainer.algorithm.advantages(batch)
    micro_loss = trainer.policy_micro_loss(batch, advantages)
    loss, sums = micro_loss(torch.arange(rollout.num_samples, device=META), 0)
    loss.backward()
    assert loss_mask.device == ref_logp.device == old_logp.device == loss.device == META
    assert all(v.device == META for v in sums.values())
    assert all(p.grad is not None and p.grad.device == META for p in trainer.model.parameters() if p.requires_grad)


def test_the_learning_half_of_a_ppo_step_keeps_every_tensor_on_the_policy_device(tiny_model, tokenizer,
                                                                                 chain_rows, tmp_path):
    config = GRPOConfig(num_generations=4, prompts_per_step=2, max_completion_length=12)
    rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy)]
    trainer = PPOTrainer(tiny_model, tokenizer, rewards, chain_rows, config, tmp_path, progress=False,
                         ppo=PPOConfig())
    rollout = cpu_rollout(tiny_model, tokenizer, chain_rows[:2])
    result = trainer._score(rollout)
    ppo = trainer.algorithm
    trainer.model, trainer.ref_model, trainer.device = on_meta(tiny_model), on_meta(trainer.ref_model), META
    ppo.critic = on_meta(ppo.critic)

    rollout, loss_mask = trainer.on_policy_device(rollout, result)
    old_logp = ppo.values(rollout).detach()  # any [N, T] on the device stands in for pi_old here
    with torch.no_grad():
        old_values = ppo.values(rollout)
    # PPO.advantages' arithmetic (its statistics read values back, which the meta device cannot)
    scores = torch.where(result.valid.to(META), result.total.to(META), 0.0).float()
    token_rewards = shaped_token_rewards(scores, old_logp, old_logp, loss_mask, config.beta)
    advantages, returns = gae_advantages(token_rewards, old_values * loss_mask, loss_mask, 1.0, 0.95)
    batch = Batch(rollout, result, loss_mask, old_logp, old_logp, tokenizer, True,
                  extras={"old_values": old_values, "returns": returns})
    rows = torch.arange(rollout.num_samples, device=META)
    policy_batch = Batch(rollout, result, loss_mask, None, old_logp, tokenizer, True)
    policy_loss, _ = trainer.policy_micro_loss(policy_batch, advantages)(rows, 0)
    critic_loss, sums = ppo.critic_micro_loss(batch)(rows, 0)
    (policy_loss + critic_loss).backward()
    assert policy_loss.device == critic_loss.device == META and all(v.device == META for v in sums.values())
    assert all(p.grad.device == META for p in ppo.critic.parameters() if p.requires_grad)
