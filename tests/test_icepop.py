"""Masked importance sampling, icepop (docs/algorithm.md, "Masked importance sampling"): a token
whose pi_old / pi_sampler leaves [low, high] loses its policy term, keeps its KL term and its
place in the count. Worked by hand, and against a float64 reference."""

import math

import pytest
import torch

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.math import grpo_loss


def batch(ratios, beta_gap=0.0):
    """One row of tokens at rho = 1 (logp = old_logp), A = +1, whose engine log-probs give `ratios`."""
    t = len(ratios)
    logp = torch.full((1, t), -1.0, dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()
    sampling = old - torch.log(torch.tensor([ratios], dtype=torch.float64))
    ref = old + beta_gap
    return logp, old, ref, sampling


def test_by_hand_dropped_tokens_lose_their_policy_term_and_keep_their_count():
    logp, old, ref, sampling = batch([0.4, 1.0, 1.5, 2.5])
    loss, stats = grpo_loss(logp, old, ref, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64),
                            beta=0.0, aggregation="token", sampling_logp=sampling, is_correction="icepop")
    # weights [0, 1.0, 1.5, 0] times the surrogate rho A = 1, over all 4 tokens: -(0 + 1 + 1.5 + 0) / 4
    assert loss.item() == pytest.approx(-0.625, abs=1e-12)
    assert stats["is_dropped_frac"].item() == 0.5
    assert stats["is_weight_mean"].item() == pytest.approx(2.5 / 4, abs=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.25, -0.375, 0.0], abs=1e-12)


def test_a_dropped_token_keeps_its_kl_term():
    logp, old, ref, sampling = batch([0.1, 1.0], beta_gap=0.5)  # ref = logp + 0.5 on both tokens
    loss, _ = grpo_loss(logp, old, ref, torch.tensor([0.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                        beta=0.1, aggregation="token", sampling_logp=sampling, is_correction="icepop")
    k3 = math.exp(0.5) - 0.5 - 1  # per token, A = 0: only the KL remains, on both tokens
    assert loss.item() == pytest.approx(0.1 * k3, abs=1e-12)


def test_bounds_are_configurable_and_tis_would_have_capped_instead():
    logp, old, ref, sampling = batch([0.4, 3.0])
    ones, adv = torch.ones(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    wide, _ = grpo_loss(logp, old, None, adv, ones, beta=0.0, aggregation="token", sampling_logp=sampling,
                        is_correction="icepop", is_args={"low": 0.3, "high": 4.0})
    assert wide.item() == pytest.approx(-(0.4 + 3.0) / 2, abs=1e-12)
    tis, stats = grpo_loss(logp, old, None, adv, ones, beta=0.0, aggregation="token", sampling_logp=sampling,
                           is_cap=2.0)
    assert tis.item() == pytest.approx(-(0.4 + 2.0) / 2, abs=1e-12) and stats["is_capped_frac"].item() == 0.5


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_matches_a_float64_reference(aggregation):
    g = torch.Generator().manual_seed(5)
    n, t, beta, eps, low, high = 5, 8, 0.04, 0.2, 0.7, 1.4
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.2
    sampling = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    ref = logp.detach() + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = [8, 3, 0, 5, 1]
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).to(torch.float64)
    loss, _ = grpo_loss(logp, old, ref, adv, mask, clip_eps=eps, beta=beta, aggregation=aggregation,
                        max_completion_length=t, sampling_logp=sampling, is_correction="icepop",
                        is_args={"low": low, "high": high})
    total, rows = 0.0, 0
    for i in range(n):
        row = 0.0
        for j in range(lengths[i]):
            rho = math.exp(logp[i, j].item() - old[i, j].item())
            a = adv[i].item()
            surrogate = min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            w = math.exp(old[i, j].item() - sampling[i, j].item())
            d = ref[i, j].item() - logp[i, j].item()
            row += (w * surrogate if low <= w <= high else 0.0) - beta * (math.exp(d) - d - 1)
        if aggregation == "sequence":
            if lengths[i]:
                total, rows = total + row / lengths[i], rows + 1
        else:
            total += row
    expected = {"sequence": total / max(rows, 1), "token": total / sum(lengths), "constant": total / (n * t)}
    assert loss.item() == pytest.approx(-expected[aggregation], rel=1e-12, abs=1e-12)


def test_the_config_names_it_and_checks_its_arguments():
    config = load_config(overrides=["--rollout.is_correction=icepop", "--rollout.is_args={low: 0.4}"])
    assert config.rollout.is_correction == "icepop"
    with pytest.raises(ConfigError, match=r"rollout.is_args: icepop: low=1.5 <= 1 <= high=2.0 must hold"):
        load_config(overrides=["--rollout.is_correction=icepop", "--rollout.is_args={low: 1.5}"])
    with pytest.raises(ConfigError, match=r"rollout.is_correction: unknown importance-sampling correction 'icepo' "
                                          r"\(did you mean 'icepop'\?\)"):
        load_config(overrides=["--rollout.is_correction=icepo"])
    with pytest.raises(ConfigError, match=r"rollout.is_args=\{'low': 0.4\} but rollout.is_correction=none"):
        load_config(overrides=["--rollout.is_args={low: 0.4}"])
