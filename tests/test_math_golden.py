"""Hand-worked golden tests for grpokit's math (docs/algorithm.md).

Every expected number below is derived by hand in the comments next to it, from the
equations of docs/algorithm.md, never by calling the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit import (
    gae_advantages,
    grpo_loss,
    kl_k3,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
    value_loss,
)
from grpokit.math import groups_with_spread, loss_denominator

F64 = torch.float64
EPS = 1e-4  # grpokit's default eps


def t64(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected, rtol=1e-12, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Clipping (docs/algorithm.md, "Clipping, worked through")
# ---------------------------------------------------------------------------


def _one_token_loss(rho, adv, clip_eps=0.2, clip_eps_high=None):
    """Loss and d loss/d logp for one token with ratio rho, beta = 0."""
    old = torch.zeros(1, 1, dtype=F64)
    logp = torch.full((1, 1), math.log(rho), dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(
        logp, old, None, t64([adv]), torch.ones(1, 1, dtype=F64),
        clip_eps=clip_eps, beta=0.0, clip_eps_high=clip_eps_high,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.item(), stats


def test_clip_positive_advantage_high_ratio_takes_1_2_and_no_gradient():
    # A = +1, rho = 1.5: unclipped 1.5*1 = 1.5, clipped clip(1.5, 0.8, 1.2)*1 = 1.2;
    # min -> 1.2, so J = 1.2 and loss = -1.2. The chosen term is a constant in logp.
    loss, grad, stats = _one_token_loss(1.5, +1.0)
    assert loss == pytest.approx(-1.2, abs=1e-12)
    assert grad == 0.0
    assert stats["clip_fraction"].item() == 1.0


def test_clip_negative_advantage_low_ratio_takes_minus_0_8_and_no_gradient():
    # A = -1, rho = 0.5: unclipped -0.5, clipped clip(0.5, 0.8, 1.2)*(-1) = -0.8;
    # min -> -0.8, J = -0.8, loss = +0.8, constant in logp.
    loss, grad, stats = _one_token_loss(0.5, -1.0)
    assert loss == pytest.approx(0.8, abs=1e-12)
    assert grad == 0.0
    assert stats["clip_fraction"].item() == 1.0


@pytest.mark.parametrize(
    "rho, adv, expected_loss",
    [
        # Inside the trust region the unclipped term is taken: loss = -rho*A and
        # d loss/d logp = d(-A exp(logp - old))/d logp = -rho*A.
        (1.1, +1.0, -1.1),
        (0.9, +1.0, -0.9),
        (1.1, -1.0, +1.1),
        (0.9, -1.0, +0.9),
        # Outside the region but in the direction the clip does NOT bite:
        # A=+1, rho=0.5: min(0.5, 0.8) = 0.5 (unclipped) -> gradient -0.5.
        (0.5, +1.0, -0.5),
        # A=-1, rho=1.5: min(-1.5, -1.2) = -1.5 (unclipped) -> gradient +1.5.
        (1.5, -1.0, +1.5),
    ],
)
def test_unclipped_side_has_policy_gradient(rho, adv, expected_loss):
    loss, grad, stats = _one_token_loss(rho, adv)
    assert loss == pytest.approx(expected_loss, abs=1e-12)
    assert grad == pytest.approx(-rho * adv, abs=1e-12)
    assert grad != 0.0
    assert stats["clip_fraction"].item() == 0.0


def test_asymmetric_clip_eps_high():
    # eps_low = 0.2, eps_high = 0.28 -> region [0.8, 1.28].
    # A=+1, rho=1.25: inside -> loss -1.25, gradient -1.25.
    loss, grad, _ = _one_token_loss(1.25, +1.0, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.25, abs=1e-12) and grad == pytest.approx(-1.25, abs=1e-12)
    # The same token with the symmetric clip: min(1.25, 1.2) = 1.2, gradient 0.
    loss, grad, _ = _one_token_loss(1.25, +1.0)
    assert loss == pytest.approx(-1.2, abs=1e-12) and grad == 0.0
    # A=+1, rho=1.5: min(1.5, 1.28) = 1.28, gradient 0.
    loss, grad, _ = _one_token_loss(1.5, +1.0, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.28, abs=1e-12) and grad == 0.0
    # The low side is unchanged: A=-1, rho=0.7: min(-0.7, -0.8) = -0.8, gradient 0.
    loss, grad, _ = _one_token_loss(0.7, -1.0, clip_eps_high=0.28)
    assert loss == pytest.approx(0.8, abs=1e-12) and grad == 0.0


def test_grpo_stats_hand_example():
    # Row 0, A=+1, ratios [1.5, 0.5, 1.0, 1.1]: surrogates min(1.5,1.2)=1.2, min(0.5,0.8)=0.5,
    #   1.0, 1.1 -> sum 3.8; only token 0 is clipped (high).
    # Row 1, A=-1, ratios [1.5, 0.5, 1.0, 0.7]: min(-1.5,-1.2)=-1.5, min(-0.5,-0.8)=-0.8,
    #   -1.0, min(-0.7,-0.8)=-0.8 -> sum -4.1; tokens 1 and 3 are clipped (low).
    # ratio_mean = (4.1 + 3.7)/8 = 0.975; clip_fraction = 3/8, low 2/8, high 1/8.
    # policy_loss = -(3.8 - 4.1)/8 = 0.0375; loss (sequence) = -(3.8/4 - 4.1/4)/2 = 0.0375.
    # ref_logp = logp except token (0, 2) where d = ref - logp = 1: k3 = e - 2, kl = (e - 2)/8.
    ratios = t64([[1.5, 0.5, 1.0, 1.1], [1.5, 0.5, 1.0, 0.7]])
    logp = ratios.log()
    old = torch.zeros_like(logp)
    ref = logp.clone()
    ref[0, 2] += 1.0
    loss, stats = grpo_loss(logp, old, ref, t64([1.0, -1.0]), torch.ones_like(logp), beta=0.0)
    assert loss.item() == pytest.approx(0.0375, abs=1e-12)
    assert stats["ratio_mean"].item() == pytest.approx(0.975, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(3 / 8, abs=1e-12)
    assert stats["clip_fraction_low"].item() == pytest.approx(2 / 8, abs=1e-12)
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 8, abs=1e-12)
    assert stats["policy_loss"].item() == pytest.approx(0.0375, abs=1e-12)
    assert stats["kl"].item() == pytest.approx((math.e - 2) / 8, abs=1e-12)
    assert stats["tokens"].item() == 8
    # With beta = 0.1 the loss gains beta * (e - 2) / 4 / 2 (row 0 has the only KL token).
    loss_b, _ = grpo_loss(logp, old, ref, t64([1.0, -1.0]), torch.ones_like(logp), beta=0.1)
    assert loss_b.item() == pytest.approx(0.0375 + 0.1 * (math.e - 2) / 8, abs=1e-12)


def test_mu_one_ratio_is_one_and_gradient_is_policy_gradient():
    # mu = 1: old_logp = logp.detach(), rho = 1 in value; A = [2, -1], lengths [2, 3], beta = 0.
    # sequence: loss = -(2 + (-1))/2 = -0.5; d loss/d logp_{i,t} = -A_i / (N * |o_i|):
    #   row 0: -2/(2*2) = -0.5, row 1: +1/(2*3) = 1/6; padded token 0.
    # token:    loss = -(2*2 - 1*3)/5 = -0.2; gradient -A_i/5: row 0 -0.4, row 1 +0.2.
    torch.manual_seed(0)
    logp = (-torch.rand(2, 3, dtype=F64)).requires_grad_()
    mask = t64([[1, 1, 0], [1, 1, 1]])
    adv = t64([2.0, -1.0])
    for agg, exp_loss, exp_grad in (
        ("sequence", -0.5, [[-0.5, -0.5, 0.0], [1 / 6, 1 / 6, 1 / 6]]),
        ("token", -0.2, [[-0.4, -0.4, 0.0], [0.2, 0.2, 0.2]]),
    ):
        loss, stats = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, aggregation=agg)
        (g,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(exp_loss, abs=1e-12)
        assert stats["ratio_mean"].item() == 1.0
        close(g, exp_grad)


# ---------------------------------------------------------------------------
# Sequence vs token aggregation on unequal lengths
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "beta, exp_seq, exp_tok",
    [
        # rho = 1 everywhere. Row 0: length 1, A=+1; row 1: length 3, A=-1.
        # sequence: -((1/1) + (-3/3))/2 = 0;   token: -(1 - 3)/4 = +0.5. They differ by 0.5.
        (0.0, 0.0, 0.5),
        # beta = 0.1 and d = ref - logp = 1 at token (0, 0): term = 1 - 0.1(e - 2) = 0.9281718...
        # sequence: -(0.92817 - 1)/2 = 0.1(e-2)/2;  token: -(0.92817 - 3)/4 = (2 + 0.1(e-2))/4.
        (0.1, 0.1 * (math.e - 2) / 2, (2 + 0.1 * (math.e - 2)) / 4),
    ],
)
def test_sequence_vs_token_aggregation(beta, exp_seq, exp_tok):
    logp = t64([[-0.3, -0.7, -0.2], [-1.1, -0.4, -0.9]])
    ref = logp.clone()
    ref[0, 0] += 1.0
    ref[0, 1] += 5.0  # padding: must not count
    mask = t64([[1, 0, 0], [1, 1, 1]])
    adv = t64([1.0, -1.0])
    seq, _ = grpo_loss(logp, logp, ref, adv, mask, beta=beta, aggregation="sequence")
    tok, _ = grpo_loss(logp, logp, ref, adv, mask, beta=beta, aggregation="token")
    assert seq.item() == pytest.approx(exp_seq, abs=1e-12)
    assert tok.item() == pytest.approx(exp_tok, abs=1e-12)
    assert tok.item() - seq.item() == pytest.approx(exp_tok - exp_seq, abs=1e-12)


def test_per_token_advantages_sequence_vs_token():
    # advantages [N, T] (process supervision), rho = 1, beta = 0.
    # Row 0: length 2, A = [1, 3] -> row mean 2.  Row 1: length 1, A = [-4] -> row mean -4.
    # sequence: -(2 - 4)/2 = 1.   token: -(1 + 3 - 4)/3 = 0.
    logp = t64([[-0.5, -0.5], [-0.5, -0.5]])
    adv = t64([[1.0, 3.0], [-4.0, 100.0]])  # 100 sits on a padded token
    mask = t64([[1, 1], [1, 0]])
    seq, _ = grpo_loss(logp, logp, None, adv, mask, beta=0.0, aggregation="sequence")
    tok, _ = grpo_loss(logp, logp, None, adv, mask, beta=0.0, aggregation="token")
    assert seq.item() == pytest.approx(1.0, abs=1e-12)
    assert tok.item() == pytest.approx(0.0, abs=1e-12)


def test_sequence_aggregation_skips_empty_rows():
    # Rows 0 and 1 (lengths 1 and 3) have A = 1 and 0.5 with rho = 1; row 2 has an all-zero mask.
    # Mean over the non-empty rows: -(1 + 0.5)/2 = -0.75 (counting row 2 as 0 would give -0.5).
    logp = torch.zeros(3, 3, dtype=F64)
    mask = t64([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    loss, _ = grpo_loss(logp, logp, None, t64([1.0, 0.5, 5.0]), mask, beta=0.0)
    assert loss.item() == pytest.approx(-0.75, abs=1e-12)


# ---------------------------------------------------------------------------
# Outcome advantages (eq. 5)
# ---------------------------------------------------------------------------


def test_outcome_eight_sample_example():
    # mean 0.5; deviations +-0.5; unbiased var = 8*0.25/7 = 2/7; std = sqrt(2/7) = 0.5345224838;
    # A = +-0.5/(0.5345224838 + 1e-4) = +-0.5/0.5346224838 = +-0.9352393794.
    r = t64([1, 0, 1, 0, 1, 0, 1, 0])
    a = outcome_advantages(r, group_size=8)
    expected = 0.5 / (math.sqrt(2 / 7) + 1e-4)
    assert expected == pytest.approx(0.935, abs=5e-4)
    close(a, [expected, -expected] * 4)
    # Dr. GRPO, no std scaling: r - mean = +-0.5 exactly.
    close(outcome_advantages(r, group_size=8, scale=False), [0.5, -0.5] * 4, rtol=0, atol=0)


def test_outcome_two_groups_normalised_separately():
    # group_size 4.
    # Group 0: [1, 0, 1, 0] -> mean 0.5, var = 4*0.25/3 = 1/3, std 0.5773502692
    #   -> A = +-0.5/(0.5773502692 + 1e-4).
    # Group 1: [3, 1, 3, 1] -> mean 2, deviations +-1, var = 4/3, std 1.1547005384
    #   -> A = +-1/(1.1547005384 + 1e-4).
    r = t64([1, 0, 1, 0, 3, 1, 3, 1])
    a = outcome_advantages(r, group_size=4)
    g0 = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    g1 = 1.0 / (math.sqrt(4 / 3) + 1e-4)
    close(a, [g0, -g0, g0, -g0, g1, -g1, g1, -g1])
    a2 = outcome_advantages(r, group_size=2)
    # group_size 2: every pair is (high, low) with deviations +-d and std = sqrt(2) d.
    # [1,0]: d = 0.5, std = 0.7071067812 ; [3,1]: d = 1, std = 1.4142135624.
    p0 = 0.5 / (math.sqrt(0.5) + 1e-4)
    p1 = 1.0 / (math.sqrt(2) + 1e-4)
    close(a2, [p0, -p0, p0, -p0, p1, -p1, p1, -p1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("value", [0.1, 1.0, 0.0, -3.7, 1e6 + 0.1])
def test_outcome_all_equal_group_is_exactly_zero(dtype, scale, value):
    # (0.1 + 0.1 + 0.1) / 3 is not exactly 0.1 in floating point, so r - mean would leave a
    # rounding residue that 1/(0 + eps) amplifies; docs/algorithm.md requires exactly 0.
    r = torch.tensor([value] * 3 + [1.0, 2.0, 4.0], dtype=dtype)
    a = outcome_advantages(r, group_size=3, scale=scale)
    assert a.dtype == dtype
    assert torch.equal(a[:3], torch.zeros(3, dtype=dtype))
    assert (a[3:] != 0).all()


def test_outcome_all_equal_python_list_float32_default():
    a = outcome_advantages([0.1] * 7, group_size=7)
    assert torch.equal(a, torch.zeros(7, dtype=a.dtype))


def test_outcome_integer_rewards_become_float():
    # [1, 0]: mean 0.5, std sqrt(0.5) -> +-0.5/(0.70710678 + 1e-4) = +-0.70700688
    a = outcome_advantages(torch.tensor([1, 0]), group_size=2)
    assert a.is_floating_point()
    exp = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(a, torch.tensor([exp, -exp], dtype=a.dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_outcome_rejects_non_finite_rewards(bad):
    with pytest.raises(ValueError, match=r"rows \[2\] are NaN or infinite"):
        outcome_advantages(t64([1.0, 0.0, bad, 1.0]), group_size=2)


@pytest.mark.parametrize("g", [1, 0, -2])
def test_outcome_group_size_below_two(g):
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2"):
        outcome_advantages(t64([1.0, 0.0, 1.0, 0.0]), group_size=g)


def test_outcome_group_size_not_int():
    with pytest.raises(ValueError, match=r"group_size must be an int"):
        outcome_advantages(t64([1.0, 0.0, 1.0, 0.0]), group_size=2.0)


def test_outcome_n_not_divisible():
    with pytest.raises(ValueError, match=r"5 rows, which is not divisible by group_size=2"):
        outcome_advantages(t64([1.0, 0.0, 1.0, 0.0, 1.0]), group_size=2)


def test_outcome_rejects_2d():
    with pytest.raises(ValueError, match=r"rewards must be 1-D \[N\], got shape \(2, 2\)"):
        outcome_advantages(t64([[1.0, 0.0], [1.0, 0.0]]), group_size=2)


# ---------------------------------------------------------------------------
# masked_outcome_advantages
# ---------------------------------------------------------------------------


def test_masked_outcome_excludes_invalid_sample():
    # Group 0: rewards [1, NaN(invalid), 0, 0.5]; valid ones [1, 0, 0.5]: mean 0.5,
    #   deviations [0.5, -0.5, 0], var = 0.5/2 = 0.25, std 0.5 -> [0.5/0.5001, 0, -0.5/0.5001, 0].
    # Group 1: rewards [7(invalid), 2, 3(invalid), 9(invalid)]: only one valid -> all 0.
    r = t64([1.0, float("nan"), 0.0, 0.5, 7.0, 2.0, 3.0, 9.0])
    v = torch.tensor([True, False, True, True, False, True, False, False])
    a = masked_outcome_advantages(r, v, group_size=4)
    x = 0.5 / 0.5001  # 0.99980004
    close(a, [x, 0.0, -x, 0.0, 0, 0, 0, 0])
    assert torch.isfinite(a).all()
    # scale=False: r - mean over the valid samples.
    close(masked_outcome_advantages(r, v, group_size=4, scale=False), [0.5, 0, -0.5, 0, 0, 0, 0, 0])


def test_masked_outcome_rejects_valid_nan_and_shape():
    r = t64([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"rows \[1\] are NaN or infinite but marked valid"):
        masked_outcome_advantages(r, torch.tensor([True, True]), group_size=2)
    with pytest.raises(ValueError, match=r"valid has shape \(3,\)"):
        masked_outcome_advantages(r, torch.tensor([True, True, True]), group_size=2)


# ---------------------------------------------------------------------------
# Process advantages (eq. 6)
# ---------------------------------------------------------------------------


def test_process_hand_example():
    # Group A (completions 0, 1):
    #   c0: step rewards [2, 2, 0] ending at tokens [0, 1, 3], 5 tokens.
    #   c1: step rewards [1, 0] ending at tokens [0, 2], 3 tokens.
    #   All steps R = [2, 2, 0, 1, 0]: mean 1, deviations [1, 1, -1, 0, -1], sum sq 4,
    #   unbiased var 4/4 = 1, std 1 -> r~ = dev / (1 + 1e-4) = dev * c, c = 0.99990001.
    #   c0 normalised [c, c, -c]; token t sums steps ending at >= t:
    #     t0: c + c - c = c; t1: c - c = 0; t2: -c; t3: -c; t4 (after the last step): 0.
    #   c1 normalised [0, -c]: t0: 0 - c = -c; t1: -c; t2: -c; t3, t4: padding 0.
    # Group B (completions 2, 3): c2 reward [1] at token 0 (1 token); c3 reward [3] at token 1
    #   (2 tokens). R = [1, 3]: mean 2, var 2, std sqrt2 -> k = 1/(sqrt2 + 1e-4) = 0.70705678.
    #   c2: [-k, 0, 0, 0, 0]; c3: [k, k, 0, 0, 0].
    c = 1 / (1 + 1e-4)
    k = 1 / (math.sqrt(2) + 1e-4)
    out = process_advantages(
        [t64([2, 2, 0]), t64([1, 0]), t64([1]), t64([3])],
        [[0, 1, 3], [0, 2], [0], [1]],
        [5, 3, 1, 2],
        group_size=2,
    )
    assert out.shape == (4, 5) and out.dtype == F64
    close(
        out,
        [
            [c, 0, -c, -c, 0],
            [-c, -c, -c, 0, 0],
            [-k, 0, 0, 0, 0],
            [k, k, 0, 0, 0],
        ],
    )


def test_process_all_equal_group_and_two_steps_same_token():
    # Group 0: every step reward 0.1 -> exactly 0 everywhere.
    # Group 1: c2 has two steps both ending at token 1, rewards [1, 0]; c3 one step [2] at 0.
    #   R = [1, 0, 2]: mean 1, var (0 + 1 + 1)/2 = 1, std 1, c = 1/1.0001.
    #   c2: both steps end at 1 -> t0 and t1 get 0 + (-c) = -c. c3: t0 gets c.
    c = 1 / (1 + 1e-4)
    out = process_advantages(
        [t64([0.1, 0.1]), t64([0.1]), t64([1.0, 0.0]), t64([2.0])],
        [[0, 2], [1], [1, 1], [0]],
        [3, 2, 2, 1],
        group_size=2,
    )
    assert torch.equal(out[:2], torch.zeros(2, 3, dtype=F64))
    close(out[2:], [[-c, -c, 0], [c, 0, 0]])


def test_process_errors():
    with pytest.raises(ValueError, match=r"one entry per completion; got 2, 1 and 2"):
        process_advantages([[1.0], [0.0]], [[0]], [1, 1], group_size=2)
    with pytest.raises(ValueError, match=r"completion 1: 2 step rewards but 1 step ends"):
        process_advantages([[1.0], [0.0, 1.0]], [[0], [0]], [1, 1], group_size=2)
    with pytest.raises(ValueError, match=r"completion 0: step ends \[3\] must lie in \[0, num_tokens=3\)"):
        process_advantages([[1.0], [0.0]], [[3], [0]], [3, 1], group_size=2)
    with pytest.raises(ValueError, match=r"completion 1: step rewards .* contain NaN"):
        process_advantages([[1.0], [float("nan")]], [[0], [0]], [1, 1], group_size=2)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2"):
        process_advantages([[1.0], [0.0]], [[0], [0]], [1, 1], group_size=1)
    with pytest.raises(ValueError, match=r"3 rows, which is not divisible by group_size=2"):
        process_advantages([[1.0], [0.0], [1.0]], [[0], [0], [0]], [1, 1, 1], group_size=2)


# ---------------------------------------------------------------------------
# k3 (eq. 4)
# ---------------------------------------------------------------------------


def test_kl_k3_specific_values():
    # k3 = exp(d) - d - 1 with d = ref - logp. logp = 0 below, so d = ref.
    ln2 = math.log(2)
    d = [0.0, 1.0, -1.0, ln2, -ln2, 1e-4, -1e-4, 1e-3, 10.0]
    expected = [
        0.0,
        math.e - 2,  # e - 1 - 1 = 0.7182818285 (the inverted formula would give 1/e)
        1 / math.e,  # e^-1 + 1 - 1 = 0.3678794412
        1 - ln2,  # 2 - ln2 - 1 = 0.3068528194
        ln2 - 0.5,  # 1/2 + ln2 - 1 = 0.1931471806
        1e-8 / 2 + 1e-12 / 6 + 1e-16 / 24,  # Taylor: d^2/2 + d^3/6 + d^4/24 = 5.0001666708e-9
        1e-8 / 2 - 1e-12 / 6 + 1e-16 / 24,  # 4.9998333375e-9
        1e-6 / 2 + 1e-9 / 6 + 1e-12 / 24 + 1e-15 / 120,  # 5.0016670834e-7
        math.exp(10) - 11,  # 22015.4657948
    ]
    out = kl_k3(torch.zeros(len(d), dtype=F64), t64(d))
    torch.testing.assert_close(out, t64(expected), rtol=1e-12, atol=0)
    assert out[0].item() == 0.0
    # The same value for any common offset of logp and ref (only d matters).
    out2 = kl_k3(torch.full((len(d),), -3.0, dtype=F64), t64(d) - 3.0)
    torch.testing.assert_close(out2, t64(expected), rtol=1e-9, atol=1e-15)


def test_kl_k3_gradient():
    # d k3 / d logp = -(exp(d) - 1): at d = 1 -> -(e - 1) = -1.7182818; at d = -1 -> 1 - 1/e = 0.6321206.
    logp = torch.zeros(3, dtype=F64, requires_grad=True)
    ref = t64([1.0, -1.0, 0.0])
    (g,) = torch.autograd.grad(kl_k3(logp, ref).sum(), logp)
    close(g, [-(math.e - 1), 1 - 1 / math.e, 0.0])


def test_kl_k3_shape_mismatch():
    with pytest.raises(ValueError, match=r"logp has shape \(2, 3\) but ref_logp \(2, 2\)"):
        kl_k3(torch.zeros(2, 3), torch.zeros(2, 2))


# ---------------------------------------------------------------------------
# grpo_loss validation
# ---------------------------------------------------------------------------


def test_grpo_loss_errors():
    z = torch.zeros(2, 3, dtype=F64)
    a = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match=r"old_logp has shape \(2, 2\) but logp has \(2, 3\)"):
        grpo_loss(z, torch.zeros(2, 2, dtype=F64), z, a, z)
    with pytest.raises(ValueError, match=r"ref_logp has shape \(3, 3\) but logp has \(2, 3\)"):
        grpo_loss(z, z, torch.zeros(3, 3, dtype=F64), a, z)
    with pytest.raises(ValueError, match=r"mask has shape \(2,\) but logp has \(2, 3\)"):
        grpo_loss(z, z, z, a, torch.ones(2))
    with pytest.raises(ValueError, match=r"advantages must be \[N\]=\(2,\) or \[N, T\]=\(2, 3\), got \(3,\)"):
        grpo_loss(z, z, z, torch.zeros(3, dtype=F64), z)
    with pytest.raises(ValueError, match=r"logp must be \[N, T\], got shape \(3,\)"):
        grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"aggregation must be one of"):
        grpo_loss(z, z, z, a, z, aggregation="mean")
    with pytest.raises(ValueError, match=r"ref_logp is None but beta=0.04"):
        grpo_loss(z, z, None, a, z)


# ---------------------------------------------------------------------------
# GAE (PPO baseline)
# ---------------------------------------------------------------------------


def test_gae_hand_example_with_padded_row():
    # gamma = 0.9, lam = 0.5, gamma*lam = 0.45.
    # Row 0 (3 valid): r = [0, 0, 1], V = [0.5, 0.6, 0.7], V past the end = 0.
    #   delta2 = 1 + 0.9*0 - 0.7 = 0.3;  delta1 = 0 + 0.9*0.7 - 0.6 = 0.03;
    #   delta0 = 0 + 0.9*0.6 - 0.5 = 0.04.
    #   A2 = 0.3; A1 = 0.03 + 0.45*0.3 = 0.165; A0 = 0.04 + 0.45*0.165 = 0.11425.
    #   returns = A + V = [0.61425, 0.765, 1.0].
    # Row 1 (2 valid, then padding with junk r = 9, V = 5 that must be ignored):
    #   delta1 = 1 + 0 - 0.4 = 0.6; delta0 = 0.5 + 0.9*0.4 - 0.2 = 0.66;
    #   A1 = 0.6; A0 = 0.66 + 0.45*0.6 = 0.93; returns [1.13, 1.0, 0].
    rewards = t64([[0.0, 0.0, 1.0], [0.5, 1.0, 9.0]])
    values = t64([[0.5, 0.6, 0.7], [0.2, 0.4, 5.0]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3], [0.93, 0.6, 0.0]])
    close(ret, [[0.61425, 0.765, 1.0], [1.13, 1.0, 0.0]])


def test_gae_defaults_gamma_one():
    # gamma = 1, lam = 0.95, one row r = [0, 2], V = [1, 1]:
    #   delta1 = 2 - 1 = 1; delta0 = 0 + 1 - 1 = 0; A1 = 1; A0 = 0 + 0.95*1 = 0.95.
    adv, ret = gae_advantages(t64([[0.0, 2.0]]), t64([[1.0, 1.0]]), t64([[1, 1]]))
    close(adv, [[0.95, 1.0]])
    close(ret, [[1.95, 2.0]])


def test_gae_shape_mismatch():
    with pytest.raises(ValueError, match=r"must share one \[N, T\] shape; got \(2, 3\), \(2, 2\) and \(2, 3\)"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"must share one \[N, T\] shape"):
        gae_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3))


# ---------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------


def test_value_loss_hand_example():
    # c = 0.2.
    # token 0: V=1, Vold=0.5, R=2: (V-R)^2 = 1; clip(V) = 0.5 + clamp(0.5, +-0.2) = 0.7,
    #          (0.7-2)^2 = 1.69 -> max 1.69 (the clipped error wins).
    # token 1: V=2, Vold=2.5, R=3: (2-3)^2 = 1; clip(V) = 2.5 - 0.2 = 2.3, (2.3-3)^2 = 0.49
    #          -> max 1 (the unclipped error wins).
    # token 2: masked out (junk R = 99).
    # loss = 0.5 * (1.69 + 1)/2 = 0.6725.  Without clipping: 0.5 * (1 + 1)/2 = 0.5.
    v = t64([[1.0, 2.0, 0.0]])
    vo = t64([[0.5, 2.5, 0.0]])
    r = t64([[2.0, 3.0, 99.0]])
    m = t64([[1, 1, 0]])
    assert value_loss(v, vo, r, m).item() == pytest.approx(0.6725, abs=1e-12)
    assert value_loss(v, vo, r, m, clip_range=None).item() == pytest.approx(0.5, abs=1e-12)
    # Gradient w.r.t. V: token 0 takes the clipped branch, constant in V -> 0;
    # token 1: d/dV 0.5*(V-R)^2/2 = (2 - 3)/2 = -0.5.
    vv = v.clone().requires_grad_()
    (g,) = torch.autograd.grad(value_loss(vv, vo, r, m), vv)
    close(g, [[0.0, -0.5, 0.0]])


def test_value_loss_shape_mismatch():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"must share one shape"):
        value_loss(z, z, torch.zeros(2, 2), z)


# ---------------------------------------------------------------------------
# Constant normaliser (Dr. GRPO): -sum m term / (N * L_max)
# ---------------------------------------------------------------------------


def test_constant_normaliser_hand_example():
    # The data of test_sequence_vs_token_aggregation: rho = 1, row 0 length 1 with A = +1,
    # row 1 length 3 with A = -1, N = 2, L_max = 4.
    # beta = 0: sum m term = 1 - 3 = -2; loss = 2 / (2 * 4) = 0.25
    #   (sequence gave 0, token 0.5: the constant divides by a number no output length changes).
    # d loss / d logp_{i,t} = -A_i / (N L_max): row 0 -> -1/8, row 1 -> +1/8, padding 0.
    # beta = 0.1, d = 1 at token (0, 0): term there 1 - 0.1(e - 2); loss = (2 + 0.1(e - 2)) / 8.
    logp = t64([[-0.3, -0.7, -0.2], [-1.1, -0.4, -0.9]]).requires_grad_()
    ref = logp.detach().clone()
    ref[0, 0] += 1.0
    ref[0, 1] += 5.0  # padding: must not count
    mask = t64([[1, 0, 0], [1, 1, 1]])
    adv = t64([1.0, -1.0])
    loss, _ = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.0, aggregation="constant", max_completion_length=4)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.25, abs=1e-12)
    close(g, [[-1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8]])
    loss_b, _ = grpo_loss(logp, logp.detach(), ref, adv, mask, beta=0.1, aggregation="constant", max_completion_length=4)
    assert loss_b.item() == pytest.approx((2 + 0.1 * (math.e - 2)) / 8, abs=1e-12)


def test_constant_normaliser_counts_empty_rows_in_n():
    # Rows of lengths 1 and 3 with A = 1 and 0.5, and an empty row: N = 3 (every completion),
    # L_max = 3: sum m term = 1 + 0.5 * 3 = 2.5 -> loss = -2.5 / 9.
    logp = torch.zeros(3, 3, dtype=F64)
    mask = t64([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    loss, _ = grpo_loss(logp, logp, None, t64([1.0, 0.5, 5.0]), mask, beta=0.0, aggregation="constant",
                        max_completion_length=3)
    assert loss.item() == pytest.approx(-2.5 / 9, abs=1e-12)


# ---------------------------------------------------------------------------
# Externally supplied denominator (micro-batches, several processes)
# ---------------------------------------------------------------------------


def test_loss_denominator_and_denominator_hand_example():
    # Same rows as above: lengths 1, 3, 0 with A = 1, 0.5, 5 and rho = 1, beta = 0.
    # Local counts: sequence 2 non-empty rows, token 4 masked tokens, constant N = 3.
    # With the counts of a larger step passed in:
    #   sequence: sum of row means 1 + 0.5 = 1.5, denominator 6 -> -0.25
    #   token:    sum of terms 1 + 1.5 = 2.5, denominator 10 -> -0.25
    #   constant: 2.5, denominator N = 5, L_max = 3 -> -2.5 / 15 = -1/6
    logp = torch.zeros(3, 3, dtype=F64)
    mask = t64([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    adv = t64([1.0, 0.5, 5.0])
    assert loss_denominator(mask, "sequence") == 2.0
    assert loss_denominator(mask, "token") == 4.0
    assert loss_denominator(mask, "constant") == 3.0
    for agg, den, expected in (("sequence", 6, -0.25), ("token", 10.0, -0.25), ("constant", t64(5.0), -1 / 6)):
        loss, _ = grpo_loss(logp, logp, None, adv, mask, beta=0.0, aggregation=agg, max_completion_length=3,
                            denominator=den)
        assert loss.item() == pytest.approx(expected, abs=1e-12)
    # A global count of 0 (no tokens anywhere) gives loss 0, not NaN.
    empty = torch.zeros(2, 3, dtype=F64)
    for agg in ("sequence", "token", "constant"):
        loss, _ = grpo_loss(logp[:2], logp[:2], None, adv[:2], empty, beta=0.0, aggregation=agg,
                            max_completion_length=3, denominator=0)
        assert loss.item() == 0.0


# ---------------------------------------------------------------------------
# Sequence-level importance ratio (GSPO)
# ---------------------------------------------------------------------------


def test_gspo_sequence_ratio_clips_in_each_direction():
    # s_i = exp(mean of the row's log-ratios) = (product of its token ratios)^(1/|o_i|); eps = 0.2.
    # Row 0, A = +1, token ratios [3, 0.75]: s = sqrt(2.25) = 1.5 > 1.2 -> min(1.5, 1.2) = 1.2 on
    #   both tokens, no gradient. (Per token, 0.75 would be unclipped: the ratio is the row's.)
    # Row 1, A = -1, token ratios [0.25, 1]: s = sqrt(0.25) = 0.5 < 0.8 -> min(-0.5, -0.8) = -0.8,
    #   no gradient.
    # Row 2, A = +1, one token ratio 0.5 (padding holds log-ratio 5, which must not enter s):
    #   s = 0.5, the side the clip does not bite -> term 0.5.
    # Row 3, A = -1, token ratios [1.21, 1]: s = 1.1, inside -> term -1.1.
    # Row 4: empty mask, junk log-ratios: s = exp(0/1) = 1, left out; no NaN.
    # sequence: row means 1.2, -0.8, 0.5, -1.1 -> sum -0.2 over 4 rows -> loss 0.05.
    # token: 2*1.2 + 2*(-0.8) + 0.5 + 2*(-1.1) = -0.9 over 7 tokens -> loss 0.9/7.
    # Gradient (sequence): row mean = s_i A_i when unclipped, d s_i / d logp_{i,t} = s_i / |o_i|:
    #   row 2: -(1/4) * 0.5 * 1 / 1 = -0.125; row 3: -(1/4) * 1.1 * (-1) / 2 = +0.1375 per token.
    # Stats: ratio_mean = (1.5*2 + 0.5*2 + 0.5 + 1.1*2)/7 = 6.7/7; clipped tokens: row 0 (high, 2),
    #   row 1 (low, 2) -> clip_fraction 4/7.
    log_ratio = t64([
        [math.log(3), math.log(0.75)],
        [math.log(0.25), 0.0],
        [math.log(0.5), 5.0],
        [math.log(1.21), 0.0],
        [7.0, -9.0],
    ])
    old = -torch.ones(5, 2, dtype=F64)
    logp = (old + log_ratio).requires_grad_()
    mask = t64([[1, 1], [1, 1], [1, 0], [1, 1], [0, 0]])
    adv = t64([1.0, -1.0, 1.0, -1.0, 3.0])
    loss, stats = grpo_loss(logp, old, None, adv, mask, beta=0.0, importance_level="sequence")
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.05, abs=1e-12)
    close(g, [[0, 0], [0, 0], [-0.125, 0], [0.1375, 0.1375], [0, 0]])
    assert stats["ratio_mean"].item() == pytest.approx(6.7 / 7, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(4 / 7, abs=1e-12)
    assert stats["clip_fraction_high"].item() == pytest.approx(2 / 7, abs=1e-12)
    assert stats["clip_fraction_low"].item() == pytest.approx(2 / 7, abs=1e-12)
    tok, _ = grpo_loss(logp, old, None, adv, mask, beta=0.0, importance_level="sequence", aggregation="token")
    assert tok.item() == pytest.approx(0.9 / 7, abs=1e-12)


def test_gspo_keeps_kl_per_token_and_small_eps():
    # GSPO's typical eps: 3e-4 low, 4e-4 high. One row, A = +1, token ratios [1.0002, 1.0004]:
    #   s = sqrt(1.0002 * 1.0004) = 1.000299985... < 1.0004 -> inside, term s.
    # KL per token: d = ref - logp = [1, 0] -> k3 = [e - 2, 0]; beta = 0.1.
    # loss = -(2 s - 0.1 (e - 2)) / 2 = -s + 0.05 (e - 2).
    # The same ratios with A = +1 but token ratios [1.0008, 1.0004] give s = 1.000599... > 1.0004:
    #   clipped to 1.0004 -> loss = -1.0004 + 0.05 (e - 2).
    old = torch.zeros(1, 2, dtype=F64)
    for ratios, surrogate in (
        ((1.0002, 1.0004), math.sqrt(1.0002 * 1.0004)),
        ((1.0008, 1.0004), 1.0004),
    ):
        logp = t64([[math.log(ratios[0]), math.log(ratios[1])]])
        ref = logp + t64([[1.0, 0.0]])
        loss, _ = grpo_loss(logp, old, ref, t64([1.0]), torch.ones(1, 2, dtype=F64), clip_eps=3e-4,
                            clip_eps_high=4e-4, beta=0.1, importance_level="sequence")
        assert loss.item() == pytest.approx(-surrogate + 0.05 * (math.e - 2), abs=1e-12)


def test_gspo_with_process_advantages():
    # [N, T] advantages under importance_level="sequence": token t uses its own A_{i,t} with the
    # row's shared s_i. One row, token ratios [3, 0.75] -> s = 1.5, A = [+1, -1]:
    #   token 0: min(1.5, 1.2) = 1.2 (clipped high, constant); token 1: min(-1.5, -1.2) = -1.5.
    #   row mean (1.2 - 1.5)/2 = -0.15 -> loss 0.15.
    # Gradient: loss = -(1.2 + s * (-1))/2, d s / d logp_t = s / 2 -> d loss / d logp_t = 1.5/4
    #   = 0.375 on BOTH tokens: token 0's term is clipped, but it shares s with token 1.
    old = torch.zeros(1, 2, dtype=F64)
    logp = t64([[math.log(3), math.log(0.75)]]).requires_grad_()
    loss, _ = grpo_loss(logp, old, None, t64([[1.0, -1.0]]), torch.ones(1, 2, dtype=F64), beta=0.0,
                        importance_level="sequence")
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(0.15, abs=1e-12)
    close(g, [[0.375, 0.375]])


def test_gspo_mu_one_ratio_is_one_and_gradient_is_policy_gradient():
    # mu = 1: s_i = exp(0) = 1 in value; d s_i / d logp_{i,t} = 1/|o_i|, so with outcome advantages
    # the gradient equals the token-level one (test_mu_one_ratio_is_one_and_gradient_is_policy_gradient):
    # A = [2, -1], lengths [2, 3]: sequence gradient row 0 -0.5, row 1 +1/6; loss -0.5.
    torch.manual_seed(0)
    logp = (-torch.rand(2, 3, dtype=F64)).requires_grad_()
    mask = t64([[1, 1, 0], [1, 1, 1]])
    loss, stats = grpo_loss(logp, logp.detach(), None, t64([2.0, -1.0]), mask, beta=0.0, importance_level="sequence")
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-0.5, abs=1e-12)
    assert stats["ratio_mean"].item() == 1.0
    close(g, [[-0.5, -0.5, 0.0], [1 / 6, 1 / 6, 1 / 6]])


# ---------------------------------------------------------------------------
# Truncated importance sampling (TIS)
# ---------------------------------------------------------------------------


def test_tis_weight_and_cap_hand_example():
    # mu = 1 (rho = 1), A = +1, beta = 0, one row of 4 tokens and a padded 5th.
    # old - sampling = [0, ln 1.5, ln 3, -ln 2] -> exp = [1, 1.5, 3, 0.5]; C = 2 -> w = [1, 1.5, 2, 0.5].
    # terms w * 1 -> sum 5 -> sequence loss -5/4 = -1.25.
    # d loss / d logp_t = -w_t A / 4 = [-0.25, -0.375, -0.5, -0.125], padding 0 (w is detached:
    #   sampling_logp and old_logp get no gradient either).
    # Stats: is_capped_frac 1/4 (only the 3 was capped; 0.5 is below the cap), is_weight_mean 5/4,
    #   logp_mismatch = (0 + ln 1.5 + ln 3 + ln 2)/4 = ln 9 / 4, policy_loss = -5/4.
    # beta = 0.1 with d = 1 at token 0 adds 0.1 (e - 2) / 4: the KL term is not reweighted.
    # is_cap = 4: w = [1, 1.5, 3, 0.5] -> loss -6/4, nothing capped.
    logp = t64([[-0.5, -1.0, -2.0, -0.1, -0.3]]).requires_grad_()
    old = logp.detach().clone()
    sampling = old - t64([[0.0, math.log(1.5), math.log(3), -math.log(2), 30.0]])  # junk on padding
    mask = t64([[1, 1, 1, 1, 0]])
    adv = t64([1.0])
    loss, stats = grpo_loss(logp, old, None, adv, mask, beta=0.0, sampling_logp=sampling)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-1.25, abs=1e-12)
    close(g, [[-0.25, -0.375, -0.5, -0.125, 0.0]])
    assert stats["is_capped_frac"].item() == pytest.approx(0.25, abs=1e-12)
    assert stats["is_weight_mean"].item() == pytest.approx(1.25, abs=1e-12)
    assert stats["logp_mismatch"].item() == pytest.approx(math.log(9) / 4, abs=1e-12)
    assert stats["policy_loss"].item() == pytest.approx(-1.25, abs=1e-12)
    ref = logp.detach() + t64([[1.0, 0, 0, 0, 0]])
    loss_b, _ = grpo_loss(logp, old, ref, adv, mask, beta=0.1, sampling_logp=sampling)
    assert loss_b.item() == pytest.approx(-1.25 + 0.1 * (math.e - 2) / 4, abs=1e-12)
    loss_c, stats_c = grpo_loss(logp, old, None, adv, mask, beta=0.0, sampling_logp=sampling, is_cap=4.0)
    assert loss_c.item() == pytest.approx(-1.5, abs=1e-12)
    assert stats_c["is_capped_frac"].item() == 0.0


def test_tis_with_token_ratio_mu_above_one():
    # mu > 1: token ratios [1.5, 0.5], A = +1, eps = 0.2.
    #   surrogates min(1.5, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5 (unclipped).
    # old - sampling = [-ln 2, ln 4] -> w = [0.5, min(4, 2) = 2].
    # terms [0.6, 1.0] -> sequence loss -1.6/2 = -0.8.
    # Gradient: token 0 clipped -> 0; token 1: -w rho A / 2 = -2 * 0.5 / 2 = -0.5.
    old = t64([[-1.0, -2.0]])
    logp = (old + t64([[math.log(1.5), math.log(0.5)]])).requires_grad_()
    sampling = old - t64([[-math.log(2), math.log(4)]])
    loss, stats = grpo_loss(logp, old, None, t64([1.0]), torch.ones(1, 2, dtype=F64), beta=0.0,
                            sampling_logp=sampling)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-0.8, abs=1e-12)
    close(g, [[0.0, -0.5]])
    assert stats["is_capped_frac"].item() == pytest.approx(0.5, abs=1e-12)


def test_gspo_tis_process_advantages_all_aggregations_mu_above_one():
    # N = 2, T = 2, L_max = 3, beta = 0, eps = 0.2.
    # Row 0: length 2, token ratios [3, 0.75] -> s0 = 1.5; A = [+1, -1];
    #   old - sampling = [ln 3, -ln 2] -> w = [2 (capped), 0.5].
    #   token 0: min(1.5, 1.2) = 1.2 (clipped) -> w * = 2.4
    #   token 1: min(-1.5, -1.2) = -1.5        -> w * = -0.75
    # Row 1: length 1, token ratio 0.5 (padding log-ratio 7) -> s1 = 0.5; A = [-1, 99 (padding)];
    #   old - sampling = [ln 1.5] -> w = 1.5; min(-0.5, -0.8) = -0.8 (clipped) -> w * = -1.2.
    # sum m term = 2.4 - 0.75 - 1.2 = 0.45.
    #   constant: -0.45 / (2 * 3) = -0.075
    #   sequence: row means (2.4 - 0.75)/2 = 0.825 and -1.2 -> -(0.825 - 1.2)/2 = 0.1875
    #   token:    -0.45 / 3 = -0.15
    # Gradient (constant): only row 0 token 1 depends on logp, through s0:
    #   d(w01 s0 A01)/d logp_{0,t} = 0.5 * (-1) * 1.5 / 2 = -0.375 -> d loss = +0.375/6 = 0.0625
    #   on both tokens of row 0; row 1 (clipped) and padding 0.
    # Stats: ratio_mean (1.5 + 1.5 + 0.5)/3; clipped: (0,0) high, (1,0) low -> 2/3;
    #   is_capped_frac 1/3; logp_mismatch (ln 3 + ln 2 + ln 1.5)/3 = ln 9 / 3.
    old = t64([[-1.0, -0.5], [-2.0, -0.2]])
    logp = (old + t64([[math.log(3), math.log(0.75)], [math.log(0.5), 7.0]])).requires_grad_()
    sampling = old - t64([[math.log(3), -math.log(2)], [math.log(1.5), -40.0]])
    adv = t64([[1.0, -1.0], [-1.0, 99.0]])
    mask = t64([[1, 1], [1, 0]])
    kw = dict(beta=0.0, importance_level="sequence", sampling_logp=sampling, max_completion_length=3)
    loss, stats = grpo_loss(logp, old, None, adv, mask, aggregation="constant", **kw)
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-0.075, abs=1e-12)
    close(g, [[0.0625, 0.0625], [0.0, 0.0]])
    assert stats["ratio_mean"].item() == pytest.approx(3.5 / 3, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3, abs=1e-12)
    assert stats["is_capped_frac"].item() == pytest.approx(1 / 3, abs=1e-12)
    assert stats["logp_mismatch"].item() == pytest.approx(math.log(9) / 3, abs=1e-12)
    seq, _ = grpo_loss(logp, old, None, adv, mask, aggregation="sequence", **kw)
    tok, _ = grpo_loss(logp, old, None, adv, mask, aggregation="token", **kw)
    assert seq.item() == pytest.approx(0.1875, abs=1e-12)
    assert tok.item() == pytest.approx(-0.15, abs=1e-12)


# ---------------------------------------------------------------------------
# Validation of the variant arguments
# ---------------------------------------------------------------------------


def test_grpo_loss_variant_errors():
    z = torch.zeros(2, 3, dtype=F64)
    a = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match=r"aggregation='constant' .* needs max_completion_length"):
        grpo_loss(z, z, z, a, z, aggregation="constant")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"max_completion_length must be an int >= 1"):
            grpo_loss(z, z, z, a, z, aggregation="constant", max_completion_length=bad)
    with pytest.raises(ValueError, match=r"importance_level must be one of \('token', 'sequence'\), got 'seq'"):
        grpo_loss(z, z, z, a, z, importance_level="seq")
    with pytest.raises(ValueError, match=r"is_cap=3.0 .* needs sampling_logp"):
        grpo_loss(z, z, z, a, z, is_cap=3.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"is_cap must be a number > 0"):
            grpo_loss(z, z, z, a, z, sampling_logp=z, is_cap=bad)
    with pytest.raises(ValueError, match=r"sampling_logp has shape \(2, 2\) but logp has \(2, 3\)"):
        grpo_loss(z, z, z, a, z, sampling_logp=torch.zeros(2, 2, dtype=F64))
    for bad in (-1, float("nan"), "4"):
        with pytest.raises(ValueError, match=r"denominator must be a count >= 0"):
            grpo_loss(z, z, z, a, z, denominator=bad)
    with pytest.raises(ValueError, match=r"denominator must be a scalar"):
        grpo_loss(z, z, z, a, z, denominator=torch.ones(2))
    with pytest.raises(ValueError, match=r"aggregation must be one of"):
        loss_denominator(z, "mean")
    with pytest.raises(ValueError, match=r"mask must be \[N, T\]"):
        loss_denominator(torch.ones(3), "token")


# ---------------------------------------------------------------------------
# Dynamic sampling (DAPO): groups with a spread
# ---------------------------------------------------------------------------


def test_groups_with_spread_hand_example():
    # group_size 4:
    #   [1, 0, 1, 0]                     -> spread                     True
    #   [1, 1, 1, 1]                     -> all equal                  False
    #   [1, NaN(inv), 0(inv), 1]         -> valid [1, 1], equal        False
    #   [0.5, 2(inv), 3(inv), 7(inv)]    -> one valid                  False
    #   [0, 0, 0, 1e-4]                  -> any difference counts      True
    #   [0.1, 0.1, 5(inv), 0.2]          -> valid [0.1, 0.1, 0.2]      True
    r = t64([1, 0, 1, 0, 1, 1, 1, 1, 1, float("nan"), 0, 1, 0.5, 2, 3, 7, 0, 0, 0, 1e-4, 0.1, 0.1, 5, 0.2])
    valid = torch.ones(24, dtype=torch.bool)
    valid[[9, 10, 13, 14, 15, 22]] = False
    out = groups_with_spread(r, valid, 4)
    assert out.dtype == torch.bool
    assert out.tolist() == [True, False, False, False, True, True]
    # valid=None: every reward counts.
    assert groups_with_spread(t64([1, 1, 2, 2, 3, 4]), None, 2).tolist() == [False, False, True]


def test_groups_with_spread_errors():
    with pytest.raises(ValueError, match=r"rows \[1\] are NaN or infinite but marked valid"):
        groups_with_spread(t64([0.0, float("nan")]), torch.tensor([True, True]), 2)
    with pytest.raises(ValueError, match=r"5 rows, which is not divisible by group_size=2"):
        groups_with_spread(torch.zeros(5, dtype=F64), None, 2)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2"):
        groups_with_spread(torch.zeros(4, dtype=F64), None, 1)
    with pytest.raises(ValueError, match=r"valid has shape \(3,\)"):
        groups_with_spread(torch.zeros(4, dtype=F64), torch.ones(3, dtype=torch.bool), 2)
