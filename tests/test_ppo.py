"""The PPO baseline: golden tests for its reward shaping, value loss and GAE wiring, and an
end-to-end run on a real tiny Llama with a real critic."""

import copy
import subprocess
import sys

import pytest
import torch
from test_grpo_trainer import length_reward, small_config
from transformers import AutoModelForTokenClassification

from grpokit.run.checkpoint import verify_checkpoint
from grpokit.config import PPOConfig
from grpokit.math import gae_advantages, value_loss
from grpokit.run.metrics import read_metrics
from grpokit.models.value import build_critic, token_values
from grpokit.train.ppo import (
    PPOTrainer,
    explained_variance,
    shaped_token_rewards,
    whiten,
)

D = torch.float64


def test_reward_shaping_golden():
    """r_t = -beta (logp_old - logp_ref), plus the outcome reward on the last valid token."""
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]], dtype=D)
    ref = torch.tensor([[-1.5, -2.0, -1.0, -9.0], [-0.5, -1.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards = shaped_token_rewards(torch.tensor([1.0, 0.0], dtype=D), old, ref, mask, beta=0.1)
    # row 0: old - ref = [0.5, 0, 0.5] -> [-0.05, 0, -0.05], +1 on token 2; padding stays 0
    # row 1: old - ref = [-0.5, 0]     -> [+0.05, 0], reward 0 on token 1
    expected = torch.tensor([[-0.05, 0.0, 0.95, 0.0], [0.05, 0.0, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(rewards, expected)


def test_reward_shaping_without_reference_is_the_outcome_alone():
    old = torch.zeros(1, 3, dtype=D)
    rewards = shaped_token_rewards(torch.tensor([2.0], dtype=D), old, None, torch.tensor([[1, 1, 1]]), beta=0.0)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0]], dtype=D))


def test_clipped_value_loss_golden():
    """0.5 * mean(max((V-R)^2, (clip(V, V_old +- 0.2) - R)^2)), by hand."""
    values = torch.tensor([[1.0, 0.0]], dtype=D)
    old = torch.tensor([[0.5, 0.5]], dtype=D)
    returns = torch.tensor([[2.0, 0.0]], dtype=D)
    # clipped V: [0.7, 0.3]; unclipped errors [1, 0]; clipped errors [1.69, 0.09]; max [1.69, 0.09]
    loss = value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.2)
    assert float(loss) == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert float(value_loss(values, old, returns, torch.ones(1, 2), clip_range=None)) == pytest.approx(0.25)


def test_gae_over_shaped_rewards_golden():
    """gamma = lam = 1: A_t = sum of rewards from t on - V_t; returns = sum of rewards from t on."""
    rewards = shaped_token_rewards(torch.tensor([1.0], dtype=D), torch.tensor([[-1.0, -1.0, -1.0]], dtype=D),
                                   torch.tensor([[-1.2, -1.0, -0.9]], dtype=D), torch.ones(1, 3), beta=0.5)
    # old - ref = [0.2, 0, -0.1] -> r = [-0.1, 0, 0.05 + 1]
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=D)
    adv, returns = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.95, 1.05, 1.05]], dtype=D))
    torch.testing.assert_close(adv, torch.tensor([[0.45, 0.45, 0.35]], dtype=D))


def test_whiten_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])
    w = whiten(x, mask)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=D))
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    assert explained_variance(returns, returns, torch.ones(1, 3)) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 3), returns, torch.ones(1, 3)) == pytest.approx(0.0)


def test_critic_starts_from_the_policy_backbone_with_zero_values(tiny_model, tokenizer):
    critic = build_critic(tiny_model)
    assert isinstance(critic, torch.nn.Module) and critic.config.num_labels == 1
    for name, tensor in tiny_model.model.state_dict().items():
        torch.testing.assert_close(critic.model.state_dict()[name], tensor)
    ids = tokenizer(["Q: 1+2\nA: 3"], return_tensors="pt")["input_ids"]
    values = token_values(critic, ids, torch.ones_like(ids), prompt_length=5)
    assert values.shape == (1, ids.shape[1] - 5) and torch.count_nonzero(values) == 0


def test_ppo_trains_policy_and_critic_and_checkpoints_both(tiny_model, tokenizer, chain_rows, tmp_path):
    data = [{"prompt": r["prompt"], "answer": r["answer"]} for r in chain_rows]
    from grpokit.data import arithmetic
    from grpokit.rewards import WeightedReward

    rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy), WeightedReward("length", length_reward)]
    policy_before = copy.deepcopy(tiny_model.state_dict())
    trainer = PPOTrainer(tiny_model, tokenizer, rewards, data, small_config(max_steps=3, save_steps=2), tmp_path,
                         progress=False, ppo=PPOConfig(critic_learning_rate=1e-3))
    critic_before = copy.deepcopy(trainer.critic.state_dict())
    history = trainer.train()
    for key in ("value/loss", "value/explained_variance", "value/clip_fraction", "kl", "clip_fraction",
                "perf/logprob_time_s", "perf/update_time_s"):
        assert key in history[-1], key
    assert history[0]["value/loss"] > 0
    assert any(not torch.equal(policy_before[k], v) for k, v in tiny_model.state_dict().items())
    assert any(not torch.equal(critic_before[k], v) for k, v in trainer.critic.state_dict().items())
    final = tmp_path / "checkpoints" / "step-3"
    assert verify_checkpoint(final) == []
    critic = AutoModelForTokenClassification.from_pretrained(final / "critic")
    for k, v in trainer.critic.state_dict().items():
        torch.testing.assert_close(critic.state_dict()[k], v)


def test_ppo_from_the_cli_runs_and_resumes(tmp_path):
    tiny = ["--model.tiny.hidden_size=32", "--model.tiny.num_layers=1", "--model.tiny.num_heads=2",
            "--model.tiny.intermediate_size=64", "--num_rl_questions=64", "--num_eval_questions=4", "--eval.k=2",
            "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=8", "--quiet"]

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", *args], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    run("--algo=ppo", f"--output_dir={tmp_path}", "--grpo.max_steps=2", *tiny)
    run(str(tmp_path / "config.yaml"), "--resume", "--grpo.max_steps=3")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all("value/loss" in r for r in rows)
