"""Property tests (hypothesis) for grpokit's math, from the invariants stated in docs/algorithm.md."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit import (
    gae_advantages,
    grpo_loss,
    kl_k3,
    masked_outcome_advantages,
    outcome_advantages,
    process_advantages,
)
from grpokit.math import groups_with_spread, loss_denominator

F64 = torch.float64
EPS = 1e-4
PROFILE = settings(max_examples=60, deadline=None)

reward_floats = st.floats(-100, 100, allow_nan=False, allow_infinity=False, allow_subnormal=False)
reward_values = st.one_of(reward_floats, st.sampled_from([0.0, 0.5, 1.0]))


@st.composite
def grouped_rewards(draw, values=reward_values):
    g = draw(st.integers(2, 8))
    k = draw(st.integers(1, 4))
    rewards = draw(st.lists(values, min_size=g * k, max_size=g * k))
    return g, rewards


def _groups(x, g):
    return [x[i : i + g] for i in range(0, len(x), g)]


# ---------------------------------------------------------------------------
# Outcome advantages
# ---------------------------------------------------------------------------


@PROFILE
@given(grouped_rewards(), st.booleans())
def test_outcome_zero_mean_per_group(data, scale):
    g, rewards = data
    adv = outcome_advantages(torch.tensor(rewards, dtype=F64), g, scale=scale).tolist()
    for r_grp, a_grp in zip(_groups(rewards, g), _groups(adv, g)):
        spread = statistics.stdev(r_grp)
        # rounding of the centring is ~ulp(max|r|) per sample, amplified by 1/(std + eps)
        tol = 1e-13 * g * (1 + max(abs(r) for r in r_grp))
        if scale:
            tol /= spread + EPS
        assert abs(math.fsum(a_grp)) <= tol


@PROFILE
@given(grouped_rewards())
def test_outcome_scaled_unit_std_per_group(data):
    g, rewards = data
    adv = outcome_advantages(torch.tensor(rewards, dtype=F64), g, scale=True).tolist()
    for r_grp, a_grp in zip(_groups(rewards, g), _groups(adv, g)):
        if all(r == r_grp[0] for r in r_grp):
            assert all(a == 0.0 for a in a_grp)  # degenerate group: exactly 0
            continue
        s_r = statistics.stdev(r_grp)
        s_a = statistics.stdev(a_grp)
        # Dividing by std + eps gives std(A) = s_r / (s_r + eps): just below 1.
        assert s_a <= 1.0 + 1e-9
        assert s_a >= 1.0 - EPS / s_r - 1e-9
        if s_r > 1e-4 * (1 + max(abs(r) for r in r_grp)):
            assert s_a == pytest.approx(s_r / (s_r + EPS), rel=1e-8)
        if s_r > 1.0:
            assert s_a == pytest.approx(1.0, abs=1e-4)


@PROFILE
@given(
    st.integers(2, 6),
    st.integers(1, 5),
    st.data(),
    st.booleans(),
)
def test_permuting_groups_permutes_outcome_advantages(g, k, data, scale):
    rewards = data.draw(st.lists(reward_values, min_size=g * k, max_size=g * k))
    perm = data.draw(st.permutations(list(range(k))))
    adv = outcome_advantages(torch.tensor(rewards, dtype=F64), g, scale=scale).view(k, g)
    permuted_rewards = torch.tensor(rewards, dtype=F64).view(k, g)[list(perm)].reshape(-1)
    adv_p = outcome_advantages(permuted_rewards, g, scale=scale).view(k, g)
    torch.testing.assert_close(adv_p, adv[list(perm)], rtol=1e-12, atol=1e-12)
    # and permuting the samples inside a group permutes their advantages
    inner = data.draw(st.permutations(list(range(g))))
    adv_i = outcome_advantages(torch.tensor(rewards, dtype=F64).view(k, g)[:, list(inner)].reshape(-1), g, scale=scale)
    torch.testing.assert_close(adv_i.view(k, g), adv[:, list(inner)], rtol=1e-12, atol=1e-12)


@PROFILE
@given(
    grouped_rewards(values=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0])),
    st.integers(-8, 8),
    st.booleans(),
)
def test_outcome_invariant_to_reward_shift(data, shift, scale):
    # mean subtraction removes any constant offset (exact in binary floats for these values)
    g, rewards = data
    a = outcome_advantages(torch.tensor(rewards, dtype=F64), g, scale=scale)
    b = outcome_advantages(torch.tensor(rewards, dtype=F64) + shift, g, scale=scale)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# k3
# ---------------------------------------------------------------------------

log_probs = st.floats(-50, 0, allow_nan=False, allow_subnormal=False)
nonzero_diff = st.tuples(st.floats(1e-6, 30, allow_subnormal=False), st.sampled_from([-1.0, 1.0])).map(
    lambda p: p[0] * p[1]
)


@PROFILE
@given(st.lists(st.tuples(log_probs, st.one_of(st.just(0.0), nonzero_diff)), min_size=1, max_size=20))
def test_k3_nonnegative_and_zero_iff_equal(pairs):
    logp = torch.tensor([p for p, _ in pairs], dtype=F64)
    ref = torch.tensor([p + d for p, d in pairs], dtype=F64)
    k = kl_k3(logp, ref)
    assert torch.isfinite(k).all()
    assert (k >= 0).all()
    assert torch.equal(k == 0, logp == ref)


@PROFILE
@given(st.lists(st.tuples(log_probs, log_probs), min_size=1, max_size=20))
def test_k3_nonnegative_float32(pairs):
    logp = torch.tensor([p for p, _ in pairs], dtype=torch.float32)
    ref = torch.tensor([r for _, r in pairs], dtype=torch.float32)
    k = kl_k3(logp, ref)
    assert torch.isfinite(k).all()
    assert (k >= 0).all()
    assert (k[logp == ref] == 0).all()


# ---------------------------------------------------------------------------
# grpo_loss gradient signs
# ---------------------------------------------------------------------------


@st.composite
def policy_batch(draw):
    n = draw(st.integers(1, 4))
    t_len = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, t_len), min_size=n, max_size=n))
    per_token = draw(st.booleans())
    adv_mag = st.floats(1e-3, 10, allow_subnormal=False)
    signed = st.tuples(adv_mag, st.sampled_from([-1.0, 1.0])).map(lambda p: p[0] * p[1])
    adv = draw(st.lists(signed, min_size=n * t_len if per_token else n, max_size=n * t_len if per_token else n))
    log_ratio = draw(st.lists(st.floats(-1.0, 1.0, allow_subnormal=False), min_size=n * t_len, max_size=n * t_len))
    old = draw(st.lists(st.floats(-8.0, 0.0, allow_subnormal=False), min_size=n * t_len, max_size=n * t_len))
    clip_eps = draw(st.sampled_from([0.1, 0.2, 0.3]))
    clip_eps_high = draw(st.sampled_from([None, 0.28, 0.5]))
    aggregation = draw(st.sampled_from(["sequence", "token"]))
    return n, t_len, lengths, per_token, adv, log_ratio, old, clip_eps, clip_eps_high, aggregation


@PROFILE
@given(policy_batch())
def test_grpo_gradient_sign_follows_advantage_and_clip(batch):
    n, t_len, lengths, per_token, adv, log_ratio, old, clip_eps, clip_eps_high, aggregation = batch
    old_t = torch.tensor(old, dtype=F64).view(n, t_len)
    logp = (old_t + torch.tensor(log_ratio, dtype=F64).view(n, t_len)).requires_grad_()
    adv_t = torch.tensor(adv, dtype=F64).view(n, t_len) if per_token else torch.tensor(adv, dtype=F64)
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(t_len)] for L in lengths], dtype=F64)
    loss, _ = grpo_loss(
        logp, old_t, None, adv_t, mask, clip_eps=clip_eps, beta=0.0,
        clip_eps_high=clip_eps_high, aggregation=aggregation,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    lo = 1 - clip_eps
    hi = 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    rho = (logp.detach() - old_t).exp()
    for i in range(n):
        for t in range(t_len):
            g = grad[i, t].item()
            if t >= lengths[i]:
                assert g == 0.0
                continue
            a = adv_t[i, t].item() if per_token else adv_t[i].item()
            r = rho[i, t].item()
            if min(abs(r - lo), abs(r - hi)) < 1e-9:
                continue  # on a kink: either one-sided derivative is acceptable
            leaving = (a > 0 and r > hi) or (a < 0 and r < lo)
            if leaving:
                assert g == 0.0, (i, t, a, r, g)
            else:
                # inside the trust region, or outside on the side the clip does not bite:
                # increasing logp lowers the loss iff A > 0
                assert g != 0.0 and math.copysign(1.0, g) == -math.copysign(1.0, a), (i, t, a, r, g)


@PROFILE
@given(policy_batch())
def test_grpo_loss_at_ratio_one(batch):
    # mu = 1 (old = logp), beta = 0: the loss is minus the (sequence- or token-) mean advantage.
    n, t_len, lengths, per_token, adv, _, old, clip_eps, clip_eps_high, aggregation = batch
    logp = torch.tensor(old, dtype=F64).view(n, t_len)
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(t_len)] for L in lengths], dtype=F64)
    adv_rows = [adv[i * t_len : i * t_len + lengths[i]] if per_token else [adv[i]] * lengths[i] for i in range(n)]
    adv_t = torch.tensor(adv, dtype=F64).view(n, t_len) if per_token else torch.tensor(adv, dtype=F64)
    loss, stats = grpo_loss(logp, logp, None, adv_t, mask, clip_eps=clip_eps, beta=0.0,
                            clip_eps_high=clip_eps_high, aggregation=aggregation)
    if aggregation == "sequence":
        expected = -math.fsum(math.fsum(row) / len(row) for row in adv_rows) / n
    else:
        expected = -math.fsum(a for row in adv_rows for a in row) / sum(lengths)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0


# ---------------------------------------------------------------------------
# Process advantages
# ---------------------------------------------------------------------------


@st.composite
def process_batch(draw):
    g = draw(st.integers(2, 4))
    n = g * draw(st.integers(1, 3))
    num_tokens = draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))
    rewards, ends = [], []
    for length in num_tokens:
        e = sorted(draw(st.sets(st.integers(0, length - 1), max_size=min(4, length))))
        r = draw(st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_subnormal=False)),
                          min_size=len(e), max_size=len(e)))
        ends.append(e)
        rewards.append(r)
    return g, rewards, ends, num_tokens


@PROFILE
@given(process_batch())
def test_process_zero_beyond_num_tokens_and_piecewise_constant(batch):
    g, rewards, ends, num_tokens = batch
    out = process_advantages([torch.tensor(r, dtype=F64) for r in rewards], ends, num_tokens, g)
    assert out.shape == (len(num_tokens), max(num_tokens))
    assert torch.isfinite(out).all()
    for i, length in enumerate(num_tokens):
        row = out[i].tolist()
        assert all(x == 0.0 for x in row[length:])  # padding
        last = ends[i][-1] if ends[i] else -1
        assert all(x == 0.0 for x in row[last + 1 : length])  # no step ends at or after these tokens
        # between consecutive step ends the credit does not change: tokens in (e_{j-1}, e_j] share it
        prev = -1
        for e in ends[i]:
            seg = row[prev + 1 : e + 1]
            assert all(x == seg[-1] for x in seg)
            prev = e


@PROFILE
@given(process_batch())
def test_process_group_credit_at_token_zero_sums_to_zero(batch):
    # Each normalised step reward is counted once at token 0 of its completion (every step ends
    # at or after token 0), so summing A_{i,0} over a group sums all normalised step rewards: 0.
    g, rewards, ends, num_tokens = batch
    out = process_advantages([torch.tensor(r, dtype=F64) for r in rewards], ends, num_tokens, g)
    for g0 in range(0, len(num_tokens), g):
        total = math.fsum(out[i, 0].item() for i in range(g0, g0 + g))
        steps = [x for i in range(g0, g0 + g) for x in rewards[i]]
        scale = 1.0 if len(steps) < 2 else statistics.stdev(steps) + EPS
        assert abs(total) <= 1e-12 * (1 + len(steps)) * (1 + max((abs(x) for x in steps), default=0)) / scale


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


@st.composite
def gae_batch(draw):
    n = draw(st.integers(1, 4))
    t_len = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, t_len), min_size=n, max_size=n))
    vals = st.floats(-5, 5, allow_subnormal=False)
    rewards = draw(st.lists(vals, min_size=n * t_len, max_size=n * t_len))
    values = draw(st.lists(vals, min_size=n * t_len, max_size=n * t_len))
    values2 = draw(st.lists(vals, min_size=n * t_len, max_size=n * t_len))
    gamma = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5]))
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(t_len)] for L in lengths], dtype=F64)
    as_t = lambda x: torch.tensor(x, dtype=F64).view(n, t_len)  # noqa: E731
    return as_t(rewards), as_t(values), as_t(values2), mask, lengths, gamma


@PROFILE
@given(gae_batch())
def test_gae_lambda_one_returns_are_discounted_reward_to_go(batch):
    # lam = 1: A_t = sum_l gamma^l r_{t+l} - V_t, so returns = A + V do not depend on V.
    rewards, values, values2, mask, lengths, gamma = batch
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=1.0)
    _, ret2 = gae_advantages(rewards, values2, mask, gamma=gamma, lam=1.0)
    torch.testing.assert_close(ret, ret2, rtol=1e-9, atol=1e-9)
    for i, L in enumerate(lengths):
        for t in range(rewards.shape[1]):
            if t >= L:
                assert adv[i, t].item() == 0.0 and ret[i, t].item() == 0.0
            else:
                g_t = math.fsum(gamma ** (k - t) * rewards[i, k].item() for k in range(t, L))
                assert ret[i, t].item() == pytest.approx(g_t, rel=1e-9, abs=1e-9)


@PROFILE
@given(gae_batch())
def test_gae_lambda_zero_is_td_error(batch):
    # lam = 0: A_t = delta_t = r_t + gamma V_{t+1} - V_t, with V = 0 after the last valid token.
    rewards, values, _, mask, lengths, gamma = batch
    adv, _ = gae_advantages(rewards, values, mask, gamma=gamma, lam=0.0)
    for i, L in enumerate(lengths):
        for t in range(L):
            v_next = values[i, t + 1].item() if t + 1 < L else 0.0
            delta = rewards[i, t].item() + gamma * v_next - values[i, t].item()
            assert adv[i, t].item() == pytest.approx(delta, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------------------
# grpo_loss variants: TIS, GSPO, constant normaliser, external denominator
# ---------------------------------------------------------------------------


def _batch_tensors(batch):
    n, t_len, lengths, per_token, adv, log_ratio, old, clip_eps, clip_eps_high, aggregation = batch
    old_t = torch.tensor(old, dtype=F64).view(n, t_len)
    logp = old_t + torch.tensor(log_ratio, dtype=F64).view(n, t_len)
    adv_t = torch.tensor(adv, dtype=F64).view(n, t_len) if per_token else torch.tensor(adv, dtype=F64)
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(t_len)] for L in lengths], dtype=F64)
    kw = dict(clip_eps=clip_eps, beta=0.0, clip_eps_high=clip_eps_high, aggregation=aggregation)
    return logp, old_t, adv_t, mask, kw


def _loss_and_grad(logp0, *args, **kw):
    logp = logp0.clone().requires_grad_()
    loss, stats = grpo_loss(logp, *args, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, stats


@PROFILE
@given(policy_batch(), st.sampled_from(["token", "sequence"]), st.sampled_from([None, 1.0, 2.0, 5.0]))
def test_tis_with_sampling_equal_to_old_changes_nothing(batch, importance_level, is_cap):
    # Identical kernels: sampling_logp == old_logp -> w = min(1, C) = 1 (C >= 1) on every token.
    logp, old, adv, mask, kw = _batch_tensors(batch)
    kw.update(importance_level=importance_level, max_completion_length=logp.shape[1])
    plain, g_plain, _ = _loss_and_grad(logp, old, None, adv, mask, **kw)
    tis, g_tis, stats = _loss_and_grad(logp, old, None, adv, mask, sampling_logp=old.clone(), is_cap=is_cap, **kw)
    assert torch.equal(tis, plain)
    assert torch.equal(g_tis, g_plain)
    assert stats["is_capped_frac"].item() == 0.0
    assert stats["logp_mismatch"].item() == 0.0
    assert stats["is_weight_mean"].item() == 1.0


@PROFILE
@given(policy_batch())
def test_gspo_mu_one_value_and_outcome_gradient_equal_token_level(batch):
    # mu = 1: s_i = 1 in value, so the loss equals the token-level one. With outcome advantages
    # the gradients agree too: d/d logp_{i,t} of |o_i| s_i A_i (token sum) is A_i s_i = A_i, the
    # same as d(rho_{i,t} A_i); sequence means and the constant scale both alike.
    logp, _, adv, mask, kw = _batch_tensors(batch)
    kw["max_completion_length"] = logp.shape[1]
    tok, g_tok, _ = _loss_and_grad(logp, logp, None, adv, mask, **kw)
    seq, g_seq, stats = _loss_and_grad(logp, logp, None, adv, mask, importance_level="sequence", **kw)
    assert seq.item() == pytest.approx(tok.item(), rel=1e-12, abs=1e-12)
    assert stats["ratio_mean"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0
    if adv.dim() == 1:
        torch.testing.assert_close(g_seq, g_tok, rtol=1e-12, atol=1e-12)


@PROFILE
@given(policy_batch(), st.integers(0, 3), st.sampled_from(["token", "sequence"]))
def test_constant_with_equal_lengths_is_a_scaled_token_mean(batch, extra, importance_level):
    # Every row has length L and L_max = L + extra: sum m term / (N L_max) = token mean * L / L_max.
    # With extra = 0 (all rows at L_max) it is the token mean itself.
    logp, old, adv, _, kw = _batch_tensors(batch)
    n, t_len = logp.shape
    mask = torch.ones(n, t_len, dtype=F64)
    kw.update(importance_level=importance_level)
    kw.pop("aggregation")
    token, g_token, _ = _loss_and_grad(logp, old, None, adv, mask, aggregation="token", **kw)
    const, g_const, _ = _loss_and_grad(logp, old, None, adv, mask, aggregation="constant",
                                       max_completion_length=t_len + extra, **kw)
    scale = t_len / (t_len + extra)
    assert const.item() == pytest.approx(token.item() * scale, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g_const, g_token * scale, rtol=1e-12, atol=1e-15)


@PROFILE
@given(policy_batch(), st.sampled_from(["token", "sequence"]), st.data())
def test_pieces_with_the_global_denominator_add_up_to_the_whole(batch, importance_level, data):
    # Micro-batches, or the shares of W processes: sum_local / global count, summed over pieces.
    logp, old, adv, mask, kw = _batch_tensors(batch)
    n = logp.shape[0]
    kw.update(importance_level=importance_level, max_completion_length=logp.shape[1] + 1)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=n - 1))) if n > 1 else []
    bounds = [0] + cuts + [n]
    whole, g_whole, _ = _loss_and_grad(logp, old, None, adv, mask, **kw)
    count = sum(loss_denominator(mask[a:b], kw["aggregation"]) for a, b in zip(bounds, bounds[1:]))
    lp = logp.clone().requires_grad_()
    total = sum(grpo_loss(lp[a:b], old[a:b], None, adv[a:b], mask[a:b], denominator=count, **kw)[0]
                for a, b in zip(bounds, bounds[1:]))
    (g_total,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(g_total, g_whole, rtol=1e-12, atol=1e-14)


@PROFILE
@given(
    st.integers(2, 6),
    st.integers(1, 4),
    st.data(),
)
def test_groups_with_spread_marks_the_groups_that_get_an_advantage(g, k, data):
    # groups_with_spread is True exactly where masked_outcome_advantages is non-zero somewhere.
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=g * k, max_size=g * k))
    valid = data.draw(st.lists(st.booleans(), min_size=g * k, max_size=g * k))
    r = torch.tensor([x if v else float("nan") for x, v in zip(rewards, valid)], dtype=F64)
    v = torch.tensor(valid)
    spread = groups_with_spread(r, v, g)
    adv = masked_outcome_advantages(r, v, g).view(k, g)
    assert spread.tolist() == (adv != 0).any(dim=1).tolist()
