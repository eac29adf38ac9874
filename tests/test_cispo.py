"""CISPO (docs/algorithm.md, "CISPO"): term_t = sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t logp_t,
worked by hand, and against a float64 reference on random batches."""

import math

import pytest
import torch

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.math import grpo_loss
from grpokit.math.cispo import cispo_term


def one_token(rho: float, advantage: float, logp: float = -0.7, **loss_args):
    logp_t = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[logp - math.log(rho)]], dtype=torch.float64)
    loss, stats = grpo_loss(logp_t, old, None, torch.tensor([advantage], dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.float64), beta=0.0, policy_loss="cispo", loss_args=loss_args)
    loss.backward()
    return loss.item(), logp_t.grad.item(), stats


def test_the_spec_examples_by_hand():
    # rho = 1.5 is clipped to 1 + 0.28: term = 1.28 * 1 * (-0.7) = -0.896, d term / d logp = 1.28
    loss, grad, stats = one_token(1.5, +1.0, eps_high=0.28)
    assert loss == pytest.approx(0.896, abs=1e-12)  # the loss is -term
    assert grad == pytest.approx(-1.28, abs=1e-12)  # d loss / d logp = -d term / d logp
    assert stats["clip_fraction_high"].item() == 1.0
    # rho = 0.5, A = -1, no lower bound (the default eps_low = 1): term = 0.5 * (-1) * (-0.7) = 0.35, gradient -0.5
    loss, grad, stats = one_token(0.5, -1.0)
    assert loss == pytest.approx(-0.35, abs=1e-12)
    assert grad == pytest.approx(0.5, abs=1e-12)
    assert stats["clip_fraction"].item() == 0.0


def test_a_lower_bound_clips_the_weight_and_the_gradient_survives():
    # eps_low = 0.2: rho = 0.5 is lifted to 0.8; the clipped surrogate would give this token no gradient
    loss, grad, _ = one_token(0.5, -1.0, eps_low=0.2)
    assert loss == pytest.approx(-(0.8 * -1.0 * -0.7), abs=1e-12)
    assert grad == pytest.approx(0.8, abs=1e-12)
    logp = torch.tensor([[-0.7]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - math.log(0.5)
    clip_loss, _ = grpo_loss(logp, old, None, torch.tensor([-1.0], dtype=torch.float64),
                             torch.ones(1, 1, dtype=torch.float64), beta=0.0)
    clip_loss.backward()
    assert logp.grad.item() == 0.0  # the clipped surrogate's flat region: CISPO's reason to exist


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_matches_a_float64_reference_with_the_kl_and_every_aggregation(aggregation):
    g = torch.Generator().manual_seed(3)
    n, t, beta, eps_low, eps_high = 6, 9, 0.04, 0.3, 0.28
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    ref = logp.detach() + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 1, 7, 0, 3])
    mask = (torch.arange(t) < lengths[:, None]).to(torch.float64)
    loss, _ = grpo_loss(logp, old, ref, adv, mask, beta=beta, aggregation=aggregation, max_completion_length=t,
                        policy_loss="cispo", loss_args={"eps_low": eps_low, "eps_high": eps_high})
    # the reference, written from the equation with plain loops
    expected, rows = 0.0, 0
    total_tokens = float(mask.sum())
    for i in range(n):
        row = 0.0
        for j in range(int(lengths[i])):
            rho = math.exp(logp[i, j].item() - old[i, j].item())
            w = min(max(rho, 1 - eps_low), 1 + eps_high)
            d = ref[i, j].item() - logp[i, j].item()
            row += w * adv[i].item() * logp[i, j].item() - beta * (math.exp(d) - d - 1)
        if aggregation == "sequence" and lengths[i] > 0:
            expected += row / int(lengths[i])
            rows += 1
        elif aggregation != "sequence":
            expected += row
    expected /= {"sequence": max(rows, 1), "token": total_tokens, "constant": n * t}[aggregation]
    assert loss.item() == pytest.approx(-expected, rel=1e-12, abs=1e-12)
    # the weight is detached: d term / d logp = w A - beta d k3 / d logp
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[mask == 0] == 0).all()


def test_cispo_term_is_the_equation():
    logp = torch.tensor([[-0.7, -1.2]], dtype=torch.float64)
    old = logp - torch.log(torch.tensor([[1.5, 0.9]], dtype=torch.float64))
    term = cispo_term(logp, old, torch.tensor([[1.0], ]), 1.0, 0.28)
    assert term[0].tolist() == pytest.approx([1.28 * -0.7, 0.9 * -1.2], abs=1e-12)


def test_the_config_names_it_and_checks_its_arguments():
    config = load_config(overrides=["--grpo.loss=cispo", "--grpo.loss_args={eps_high: 0.5}"])
    assert config.grpo.loss == "cispo" and config.grpo.loss_args == {"eps_high": 0.5}
    with pytest.raises(ConfigError, match=r"grpo.loss: unknown policy loss 'cipso' \(did you mean 'cispo'\?\)"):
        load_config(overrides=["--grpo.loss=cipso"])
    with pytest.raises(ConfigError, match=r"grpo.loss_args: cispo takes eps_high, eps_low; got eps"):
        load_config(overrides=["--grpo.loss=cispo", "--grpo.loss_args={eps: 0.2}"])
    with pytest.raises(ConfigError, match=r"grpo.loss_args: cispo: eps_high must be a number >= 0, got -1"):
        load_config(overrides=["--grpo.loss=cispo", "--grpo.loss_args={eps_high: -1}"])
    with pytest.raises(ConfigError, match="grpo.importance_sampling_level=sequence applies to grpo.loss=clip"):
        load_config(overrides=["--grpo.loss=cispo", "--grpo.importance_sampling_level=sequence"])


@pytest.mark.parametrize("loss", [["--grpo.loss=cispo"],
                                  ["--grpo.loss=custom_loss:clipped_ratio_only", "--grpo.loss_args={eps: 0.1}"]])
def test_grpokit_train_runs_a_registered_loss_by_name(tmp_path, loss):
    """CISPO by its registered name, and the docs' complete example of a user's own loss by import path
    (examples/custom_loss.py, that folder on PYTHONPATH): two GRPO steps that move the weights."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo / "examples"), str(repo / "tests")])}
    proc = subprocess.run([sys.executable, "-m", "grpokit", "train", f"--output_dir={tmp_path / 'run'}", *loss,
                           "--model.tiny.hidden_size=32", "--model.tiny.num_layers=2", "--model.tiny.num_heads=2",
                           "--model.tiny.intermediate_size=64", "--num_rl_questions=64", "--num_eval_questions=4",
                           "--eval.k=2", "--eval.before=false", "--grpo.max_steps=2", "--prompts_per_step=2",
                           "--num_generations=4", "--max_completion_length=12", "--grpo.learning_rate=1e-3",
                           "--rewards=[{name: 'test_distributed:length_reward'}]", "--quiet"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
