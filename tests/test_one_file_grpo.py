"""examples/grpo_in_one_file.py agrees with `grpokit train`.

From the same pi_SFT and seed, the one file and `grpokit train` (here through grpokit.train, the same run:
tests/test_front_door.py) sample the same completions: both draw them with transformers' `generate` from
torch's global random stream, seeded with the run's seed just before the first step, in the same question
order, and both draw one `randperm` per update for the minibatch order. So the per-step mean reward must
be equal exactly, and the loss, KL and gradient norm within float tolerance: grpokit sums the loss over micro-batches
sorted by length (and may pack rows), the one file in one padded forward, so the sums run in another order.

What a run cannot show, because one update per batch keeps rho = 1 (the clip never binds): the clipped
objective with pi_old != pi_theta. That is compared on the same tensors against grpokit.math, as are the
advantages (eq. 5).

pi_SFT is a fresh tiny model; its completions are noise, so the reward is one that varies on noise (the
share of digits), which gives every group a spread and every step a non-zero advantage and loss.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpokit
from grpokit.checks import load_config
from grpokit.data import arithmetic
from grpokit.math import grpo_loss, outcome_advantages
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.run.checkpoint import save_checkpoint
from grpokit.train.schedule import warmup_constant

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_in_one_file.py"
spec = importlib.util.spec_from_file_location("grpo_in_one_file", EXAMPLE)
one_file = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = one_file
spec.loader.exec_module(one_file)

STEPS, B, G, TOKENS, LR, WARMUP, QUESTIONS = 3, 4, 4, 16, 1e-3, 2, 200


def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.fixture(scope="module")
def pi_sft(tmp_path_factory):
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return save_checkpoint(model, tokenizer, tmp_path_factory.mktemp("pi") / "sft")


def test_the_one_file_gives_grpokit_trains_rewards_and_losses(pi_sft, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = grpokit.train(str(pi_sft), rewards=[digit_share], output_dir="run", progress=False, config={
        "grpo.max_steps": STEPS, "grpo.prompts_per_step": B, "grpo.num_generations": G,
        "grpo.max_completion_length": TOKENS, "grpo.learning_rate": LR, "grpo.warmup_steps": WARMUP,
        "task.num_rl_questions": QUESTIONS, "task.num_eval_questions": 4, "eval.before": False, "eval.k": 0,
        "eval.tir": False, "model.dtype": "fp32", "model.device": "cpu"})

    settings = one_file.Settings(steps=STEPS, questions_per_step=B, group_size=G, max_new_tokens=TOKENS,
                                 learning_rate=LR, warmup_steps=WARMUP, num_questions=QUESTIONS)
    policy = AutoModelForCausalLM.from_pretrained(pi_sft, dtype=torch.float32)
    mine = one_file.train(policy, AutoTokenizer.from_pretrained(pi_sft), settings, reward_fn=digit_share,
                          log=lambda line: None)

    theirs = run.metrics
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [1, 2, 3]
    assert [r["reward/mean"] for r in mine] == pytest.approx([r["reward/mean"] for r in theirs], abs=1e-7)
    assert [r["loss"] for r in mine] == pytest.approx([r["loss"] for r in theirs], rel=1e-4, abs=1e-6)
    assert [r["kl"] for r in mine] == pytest.approx([r["kl"] for r in theirs], rel=1e-3, abs=1e-8)
    assert [r["grad_norm"] for r in mine] == pytest.approx([r["grad_norm"] for r in theirs], rel=1e-4)
    # Not vacuous: the steps differ, every step has a gradient, and the KL grows from 0 after the first update.
    # (The loss's value is about beta x KL: with rho = 1 the surrogate's mean is each group's mean advantage,
    # 0; its gradient is the policy gradient, which grad_norm compares.)
    assert len({round(r["reward/mean"], 6) for r in mine}) == STEPS
    assert all(r["grad_norm"] > 1e-3 for r in mine) and mine[0]["kl"] == 0.0 < mine[-1]["kl"]


def test_the_one_files_advantages_and_clipped_loss_are_grpokits():
    torch.manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.9, 0.4, 0.0])
    mine = one_file.group_advantages(rewards, group_size=4)
    assert torch.allclose(mine, outcome_advantages(rewards, group_size=4), atol=1e-6)
    assert (mine[4:8] == 0).all()  # all equal: exactly 0

    n, t = 12, 7
    logp = -torch.rand(n, t) * 3
    old = logp + torch.randn(n, t) * 0.4  # pi_old != pi_theta: ratios beyond 1 +- eps, the clip binds
    ref = logp + torch.randn(n, t) * 0.3
    mask = (torch.rand(n, t) > 0.2).long()
    mask[3] = 0  # an empty completion counts for nothing
    loss, kl = one_file.grpo_loss(logp, old, ref, mine, mask, epsilon=0.2, beta=0.04)
    expected, stats = grpo_loss(logp, old, ref, mine, mask, clip_eps=0.2, beta=0.04)
    assert stats["clip_fraction"] > 0.1
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert kl.item() == pytest.approx(stats["kl"].item(), rel=1e-6)


def test_the_one_files_defaults_are_the_config_schemas():
    """Each Settings field whose comment names a config key has that key's default (grpokit train --help)."""
    config = load_config()
    named = re.findall(r"^    (\w+): \w+ = [^#\n]+# (?:\w+, )?([a-z_]+\.[a-z_.]+)", EXAMPLE.read_text(), re.M)
    assert len(named) >= 14, named
    for field, key in named:
        section, name = key.split(".")
        assert getattr(one_file.Settings(), field) == getattr(getattr(config, section), name), (field, key)


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_the_one_files_warm_up_is_grpokits_zero_included(warmup):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = warmup_constant(optimizer, warmup)
    settings = one_file.Settings(learning_rate=1e-3, warmup_steps=warmup)
    for step in range(5):
        assert one_file.learning_rate(settings, step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
        optimizer.step()
        scheduler.step()
