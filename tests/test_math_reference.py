"""grpokit's math against an independent float64 reference written from docs/algorithm.md.

The reference below uses plain Python loops over floats (or per-element torch scalar ops
where autograd is needed). It follows the equations of docs/algorithm.md directly -- e.g. GAE as the
explicit sum A_t = sum_l (gamma lam)^l delta_{t+l}, process advantages as the explicit sum
over the steps ending at or after t -- rather than mirroring the vectorised implementation.
"""

from __future__ import annotations

import math
import random

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
from grpokit.math import loss_denominator

F64 = torch.float64
RTOL = 1e-10
ATOL = 1e-12
EPS = 1e-4
SEEDS = list(range(20))


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=rtol, atol=atol
    )


# ---------------------------------------------------------------------------
# Reference implementation (loops, float64)
# ---------------------------------------------------------------------------


def _mean_std(vals):
    """Mean and unbiased sample std of a list of floats."""
    n = len(vals)
    mean = math.fsum(vals) / n
    var = math.fsum((v - mean) ** 2 for v in vals) / (n - 1)
    return mean, math.sqrt(var)


def ref_outcome(rewards, group_size, scale=True, eps=EPS, valid=None):
    """eq. 5 over the (valid) samples of each contiguous group; 0 for degenerate groups."""
    n = len(rewards)
    out = [0.0] * n
    for g0 in range(0, n, group_size):
        idx = [i for i in range(g0, g0 + group_size) if valid is None or valid[i]]
        vals = [rewards[i] for i in idx]
        if len(vals) < 2 or all(v == vals[0] for v in vals):
            continue  # nothing to compare: advantage 0
        mean, std = _mean_std(vals)
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if scale else rewards[i] - mean
    return out


def ref_process(step_rewards, step_ends, num_tokens, group_size, eps=EPS):
    """eq. 6: A_{i,t} = sum over steps j of i with end_j >= t of the group-normalised reward."""
    n = len(step_rewards)
    t_max = max(num_tokens)
    out = [[0.0] * t_max for _ in range(n)]
    for g0 in range(0, n, group_size):
        group = range(g0, g0 + group_size)
        all_steps = [r for i in group for r in step_rewards[i]]
        if len(all_steps) < 2 or all(r == all_steps[0] for r in all_steps):
            continue
        mean, std = _mean_std(all_steps)
        for i in group:
            for t in range(num_tokens[i]):
                out[i][t] = math.fsum(
                    (r - mean) / (std + eps) for r, e in zip(step_rewards[i], step_ends[i]) if e >= t
                )
    return out


def ref_k3_float(d):
    """exp(d) - d - 1 for a float d, accurate in float64 (Taylor series near 0)."""
    if abs(d) < 0.1:
        term, total = d, 0.0
        for k in range(2, 25):
            term = term * d / k
            total += term
        return total
    return math.exp(d) - d - 1.0


def ref_gae(rewards, values, mask, gamma, lam):
    """GAE over each row's valid tokens, as the explicit sum of discounted deltas."""
    n, t_len = len(rewards), len(rewards[0])
    adv = [[0.0] * t_len for _ in range(n)]
    ret = [[0.0] * t_len for _ in range(n)]
    for i in range(n):
        pos = [t for t in range(t_len) if mask[i][t]]
        v = [values[i][t] for t in pos] + [0.0]  # V = 0 past the last valid token
        r = [rewards[i][t] for t in pos]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        for k, t in enumerate(pos):
            a = math.fsum((gamma * lam) ** l * deltas[k + l] for l in range(len(pos) - k))
            adv[i][t] = a
            ret[i][t] = a + v[k]
    return adv, ret


def ref_value_loss(values, old_values, returns, mask, clip_range):
    errs = []
    for i in range(len(values)):
        for t in range(len(values[0])):
            if not mask[i][t]:
                continue
            v, vo, r = values[i][t], old_values[i][t], returns[i][t]
            e = (v - r) ** 2
            if clip_range is not None:
                vc = min(max(v, vo - clip_range), vo + clip_range)
                e = max(e, (vc - r) ** 2)
            errs.append(e)
    return 0.5 * math.fsum(errs) / len(errs)


def ref_grpo(logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, clip_eps_high, aggregation):
    """eq. 3 token by token with torch scalar ops (so autograd gives the reference gradient).

    Returns (loss tensor, stats dict of floats).
    """
    n, t_len = logp.shape
    lo = 1.0 - clip_eps
    hi = 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)
    rows = []
    kls, ratios, clipped_flags = [], [], []
    for i in range(n):
        terms = []
        for t in range(t_len):
            if mask[i, t].item() == 0:
                continue
            a = advantages[i] if advantages.dim() == 1 else advantages[i, t]
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            unclipped = rho * a
            rv = rho.item()
            if rv > hi:
                clipped = hi * a  # clip(rho) is the constant bound: no gradient through it
            elif rv < lo:
                clipped = lo * a
            else:
                clipped = rho * a
            is_clipped = clipped.item() < unclipped.item()
            surrogate = clipped if is_clipped else unclipped
            if ref_logp is not None:
                d = ref_logp[i, t] - logp[i, t]
                k3 = torch.exp(d) - d - 1.0
                kls.append(ref_k3_float(d.item()))
            else:
                k3 = 0.0
                kls.append(0.0)
            ratios.append(rv)
            clipped_flags.append(1.0 if is_clipped else 0.0)
            terms.append(surrogate - beta * k3)
        rows.append(terms)
    if aggregation == "sequence":
        per_seq = [sum(ts) / len(ts) for ts in rows if ts]
        loss = -sum(per_seq) / len(per_seq)
    else:
        flat = [x for ts in rows for x in ts]
        loss = -sum(flat) / len(flat)
    ntok = len(ratios)
    stats = {
        "kl": math.fsum(kls) / ntok,
        "clip_fraction": math.fsum(clipped_flags) / ntok,
        "ratio_mean": math.fsum(ratios) / ntok,
    }
    return loss, stats


# ---------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------


def random_rewards(rng, n_groups, g):
    out = []
    for _ in range(n_groups):
        kind = rng.choice(["normal", "binary", "equal", "few_levels"])
        if kind == "normal":
            out += [rng.gauss(0.0, rng.choice([0.01, 1.0, 10.0])) for _ in range(g)]
        elif kind == "binary":
            out += [float(rng.random() < 0.5) for _ in range(g)]
        elif kind == "equal":
            out += [rng.choice([0.1, 0.0, 1.0, 0.3])] * g
        else:
            out += [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(g)]
    return out


def random_lengths(rng, n, t_len):
    lengths = [rng.randint(1, t_len) for _ in range(n)]
    # Some rows of length 1, and (often) one full-length row.
    for i in rng.sample(range(n), k=max(1, n // 3)):
        lengths[i] = 1
    if rng.random() < 0.7:
        lengths[rng.randrange(n)] = t_len
    return lengths


def prefix_mask(lengths, t_len):
    return torch.tensor([[1.0 if t < length else 0.0 for t in range(t_len)] for length in lengths], dtype=F64)


# ---------------------------------------------------------------------------
# Outcome advantages
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [True, False])
def test_outcome_matches_reference(seed, scale):
    rng = random.Random(seed)
    g = rng.randint(2, 8)
    n_groups = rng.randint(1, 5)
    eps = rng.choice([EPS, 1e-6, 0.1])
    rewards = random_rewards(rng, n_groups, g)
    got = outcome_advantages(torch.tensor(rewards, dtype=F64), g, scale=scale, eps=eps)
    assert got.dtype == F64 and got.shape == (n_groups * g,)
    assert_close(got, ref_outcome(rewards, g, scale=scale, eps=eps))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [True, False])
def test_masked_outcome_matches_reference(seed, scale):
    rng = random.Random(1000 + seed)
    g = rng.randint(2, 8)
    n_groups = rng.randint(1, 5)
    rewards = random_rewards(rng, n_groups, g)
    valid = [rng.random() < 0.7 for _ in rewards]
    if rng.random() < 0.5:  # a group with a single valid sample
        k = rng.randrange(n_groups)
        for i in range(k * g, k * g + g):
            valid[i] = i == k * g
    # invalid samples carry garbage that must be ignored
    rewards_in = [r if v else rng.choice([float("nan"), float("inf"), 1e9]) for r, v in zip(rewards, valid)]
    got = masked_outcome_advantages(
        torch.tensor(rewards_in, dtype=F64), torch.tensor(valid), g, scale=scale, eps=EPS
    )
    assert_close(got, ref_outcome(rewards, g, scale=scale, eps=EPS, valid=valid))


# ---------------------------------------------------------------------------
# Process advantages
# ---------------------------------------------------------------------------


def random_process_inputs(rng):
    g = rng.randint(2, 5)
    n = g * rng.randint(1, 3)
    num_tokens = [rng.randint(1, 12) for _ in range(n)]
    num_tokens[rng.randrange(n)] = 1
    step_rewards, step_ends = [], []
    for length in num_tokens:
        k = rng.randint(0, min(4, length))
        ends = sorted(rng.sample(range(length), k))
        if k and rng.random() < 0.5:
            ends[-1] = length - 1  # the last step often ends at the last token
        if rng.random() < 0.3:
            rewards = [float(rng.random() < 0.5) for _ in ends]
        else:
            rewards = [rng.gauss(0, 1) for _ in ends]
        step_rewards.append(rewards)
        step_ends.append(ends)
    return g, step_rewards, step_ends, num_tokens


@pytest.mark.parametrize("seed", SEEDS + [100 + s for s in SEEDS])
def test_process_matches_reference(seed):
    rng = random.Random(2000 + seed)
    g, step_rewards, step_ends, num_tokens = random_process_inputs(rng)
    got = process_advantages(
        [torch.tensor(r, dtype=F64) for r in step_rewards], step_ends, num_tokens, g
    )
    assert got.dtype == F64
    assert got.shape == (len(num_tokens), max(num_tokens))
    assert_close(got, ref_process(step_rewards, step_ends, num_tokens, g))


def test_process_single_step_at_end_equals_outcome_reference():
    # One step per completion ending at its last token: eq. 6 reduces to eq. 5 on every token.
    rng = random.Random(7)
    g, n = 4, 12
    rewards = random_rewards(rng, n // g, g)
    num_tokens = [rng.randint(1, 9) for _ in range(n)]
    got = process_advantages([torch.tensor([r], dtype=F64) for r in rewards], [[L - 1] for L in num_tokens], num_tokens, g)
    expected_outcome = ref_outcome(rewards, g)
    expected = [[expected_outcome[i] if t < num_tokens[i] else 0.0 for t in range(max(num_tokens))] for i in range(n)]
    assert_close(got, expected)


# ---------------------------------------------------------------------------
# k3
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_k3_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 10, (1,), generator=gen)))
    logp = -torch.rand(shape, generator=gen, dtype=F64) * 10
    # |d| from 1e-7 to 10, both signs, so both sides of any small-|d| special case are hit
    mag = 10 ** (torch.rand(shape, generator=gen, dtype=F64) * 8 - 7)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    ref = logp + sign * mag
    got = kl_k3(logp, ref)
    d = (ref - logp).tolist()
    expected = [[ref_k3_float(x) for x in row] for row in d]
    assert_close(got, expected, rtol=RTOL, atol=0.0)


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_reference(seed):
    rng = random.Random(3000 + seed)
    gen = torch.Generator().manual_seed(seed)
    n, t_len = rng.randint(1, 6), rng.randint(1, 15)
    gamma = rng.choice([1.0, 0.99, 0.9, 0.5])
    lam = rng.choice([1.0, 0.95, 0.7, 0.0])
    lengths = random_lengths(rng, n, t_len)
    mask = prefix_mask(lengths, t_len)
    rewards = torch.randn(n, t_len, generator=gen, dtype=F64)
    values = torch.randn(n, t_len, generator=gen, dtype=F64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    e_adv, e_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    assert_close(adv, e_adv)
    assert_close(ret, e_ret)


def test_gae_mask_with_holes_matches_reference():
    # Documented in gae_advantages: valid tokens are taken in order, skipping masked positions.
    gen = torch.Generator().manual_seed(11)
    n, t_len = 5, 10
    mask = (torch.rand(n, t_len, generator=gen) < 0.6).to(F64)
    mask[0] = 0.0  # an empty row
    rewards = torch.randn(n, t_len, generator=gen, dtype=F64)
    values = torch.randn(n, t_len, generator=gen, dtype=F64)
    for gamma, lam in ((0.9, 0.8), (1.0, 1.0)):
        adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
        e_adv, e_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        assert_close(adv, e_adv)
        assert_close(ret, e_ret)


# ---------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_reference(seed):
    rng = random.Random(4000 + seed)
    gen = torch.Generator().manual_seed(seed)
    n, t_len = rng.randint(1, 6), rng.randint(1, 12)
    mask = prefix_mask(random_lengths(rng, n, t_len), t_len)
    values = torch.randn(n, t_len, generator=gen, dtype=F64)
    old = values + 0.4 * torch.randn(n, t_len, generator=gen, dtype=F64)
    returns = torch.randn(n, t_len, generator=gen, dtype=F64)
    for clip in (0.2, 0.05, None):
        got = value_loss(values, old, returns, mask, clip_range=clip)
        exp = ref_value_loss(values.tolist(), old.tolist(), returns.tolist(), mask.tolist(), clip)
        assert_close(got, exp)


# ---------------------------------------------------------------------------
# grpo_loss: values, stats and gradients
# ---------------------------------------------------------------------------


def random_grpo_inputs(seed, per_token_adv):
    rng = random.Random(5000 + seed)
    gen = torch.Generator().manual_seed(5000 + seed)
    n, t_len = rng.randint(1, 6), rng.randint(1, 10)
    lengths = random_lengths(rng, n, t_len)
    mask = prefix_mask(lengths, t_len)
    logp = -torch.rand(n, t_len, generator=gen, dtype=F64) * 4
    # log-ratios spread over both sides of the trust region
    old = logp - 0.35 * torch.randn(n, t_len, generator=gen, dtype=F64)
    ref = logp + 0.5 * torch.randn(n, t_len, generator=gen, dtype=F64)
    if per_token_adv:
        adv = torch.randn(n, t_len, generator=gen, dtype=F64)
    else:
        adv = torch.randn(n, generator=gen, dtype=F64)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("seed", list(range(8)))
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("aggregation", ["sequence", "token"])
@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
def test_grpo_loss_value_stats_and_gradient_match_reference(seed, per_token_adv, aggregation, clip_eps_high):
    logp0, old, ref, adv, mask = random_grpo_inputs(seed, per_token_adv)
    beta = [0.0, 0.04, 0.5][seed % 3]
    clip_eps = [0.2, 0.1][seed % 2]
    kw = dict(clip_eps=clip_eps, beta=beta, clip_eps_high=clip_eps_high, aggregation=aggregation)

    logp = logp0.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, ref, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)

    logp_r = logp0.clone().requires_grad_()
    e_loss, e_stats = ref_grpo(logp_r, old, ref, adv, mask, clip_eps, beta, clip_eps_high, aggregation)
    (e_grad,) = torch.autograd.grad(e_loss, logp_r)

    assert loss.dtype == F64 and loss.dim() == 0
    assert_close(loss, e_loss.detach())
    assert_close(grad, e_grad)
    assert (grad[mask == 0] == 0).all()
    assert_close(stats["kl"], e_stats["kl"])
    assert_close(stats["clip_fraction"], e_stats["clip_fraction"])
    assert_close(stats["ratio_mean"], e_stats["ratio_mean"])
    for v in stats.values():
        assert not v.requires_grad


@pytest.mark.parametrize("seed", list(range(4)))
def test_grpo_loss_without_ref_matches_reference(seed):
    logp0, old, _, adv, mask = random_grpo_inputs(seed, per_token_adv=False)
    logp = logp0.clone().requires_grad_()
    loss, _ = grpo_loss(logp, old, None, adv, mask, beta=0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_r = logp0.clone().requires_grad_()
    e_loss, _ = ref_grpo(logp_r, old, None, adv, mask, 0.2, 0.0, None, "sequence")
    (e_grad,) = torch.autograd.grad(e_loss, logp_r)
    assert_close(loss, e_loss.detach())
    assert_close(grad, e_grad)


def _away_from_kinks(gen, n, t_len, lo, hi, margin=2e-3):
    """log-ratios whose ratio is at least `margin` away from the clip bounds."""
    lr = 0.3 * torch.randn(n, t_len, generator=gen, dtype=F64)
    rho = lr.exp()
    near = ((rho - lo).abs() < margin) | ((rho - hi).abs() < margin)
    lr = torch.where(near, lr + 5 * margin, lr)
    rho = lr.exp()
    assert not (((rho - lo).abs() < margin / 2) | ((rho - hi).abs() < margin / 2)).any()
    return lr


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_grpo_loss_gradcheck(aggregation, clip_eps_high, per_token_adv):
    gen = torch.Generator().manual_seed(17)
    n, t_len = 3, 4
    hi = 1 + (0.2 if clip_eps_high is None else clip_eps_high)
    lr = _away_from_kinks(gen, n, t_len, 0.8, hi)
    old = -torch.rand(n, t_len, generator=gen, dtype=F64) * 3
    logp = (old + lr).requires_grad_()
    ref = (logp.detach() + 0.5 * torch.randn(n, t_len, generator=gen, dtype=F64)).requires_grad_()
    shape = (n, t_len) if per_token_adv else (n,)
    a = torch.randn(shape, generator=gen, dtype=F64)
    adv = torch.where(a.abs() < 0.1, a + 0.3 * a.sign() + 0.2, a).requires_grad_()  # away from A = 0
    mask = prefix_mask([4, 1, 3], t_len)
    rho = lr.exp()
    assert ((rho < 0.8) | (rho > hi)).any() and ((rho > 0.8) & (rho < hi)).any()  # both regimes

    def f(lp, rf, ad):
        return grpo_loss(lp, old, rf, ad, mask, beta=0.1, clip_eps_high=clip_eps_high, aggregation=aggregation)[0]

    assert torch.autograd.gradcheck(f, (logp, ref, adv), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_kl_k3_gradcheck():
    d = torch.tensor(
        [-3.0, -1.0, -0.2, -2e-3, -9.99e-4, -1e-4, 1e-5, 5e-4, 1.001e-3, 3e-3, 0.5, 2.0], dtype=F64
    )
    logp = (-torch.linspace(0.1, 5, d.numel(), dtype=F64)).requires_grad_()
    ref = (logp.detach() + d).requires_grad_()
    assert torch.autograd.gradcheck(kl_k3, (logp, ref), eps=1e-6, atol=1e-9, rtol=1e-6)
    # and the analytic gradient: d k3/d logp = 1 - exp(d), d k3/d ref = exp(d) - 1
    g_lp, g_ref = torch.autograd.grad(kl_k3(logp, ref).sum(), (logp, ref))
    dd = (ref - logp).detach().tolist()
    assert_close(g_lp, [-math.expm1(x) for x in dd])
    assert_close(g_ref, [math.expm1(x) for x in dd])


# ---------------------------------------------------------------------------
# grpo_loss variants: constant normaliser, GSPO's sequence ratio, TIS, external denominator
# ---------------------------------------------------------------------------


def ref_grpo_variants(
    logp, old_logp, ref_logp, advantages, mask, clip_eps, beta, clip_eps_high, aggregation,
    l_max=None, importance_level="token", sampling_logp=None, is_cap=2.0, denominator=None,
):
    """The variants' formulas token by token, with torch scalar ops for the reference gradient.

    GSPO:  s_i = exp(sum_t m (logp - old) / sum_t m); the ratio of every token of row i is s_i.
    TIS:   w_t = min(exp(old - sampling), C), a plain float (no gradient).
    term_t = w_t * min(rho A, clip(rho) A) - beta k3_t.
    sequence: sum_i (row mean) / #non-empty rows; token: sum / #tokens; constant: sum / (N L_max);
    `denominator` replaces the count (N for constant).
    """
    n, t_len = logp.shape
    lo = 1.0 - clip_eps
    hi = 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)
    rows = []
    kls, ratios, clipped_flags, surrogates, weights, capped, mismatch = [], [], [], [], [], [], []
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t].item() != 0]
        if importance_level == "sequence" and tokens:
            mean_log_ratio = sum(logp[i, t] - old_logp[i, t] for t in tokens) / len(tokens)
            s_i = torch.exp(mean_log_ratio)
        terms = []
        for t in tokens:
            a = advantages[i] if advantages.dim() == 1 else advantages[i, t]
            rho = s_i if importance_level == "sequence" else torch.exp(logp[i, t] - old_logp[i, t])
            unclipped = rho * a
            rv = rho.item()
            if rv > hi:
                clipped = hi * a
            elif rv < lo:
                clipped = lo * a
            else:
                clipped = rho * a
            is_clipped = clipped.item() < unclipped.item()
            surrogate = clipped if is_clipped else unclipped
            w = 1.0
            if sampling_logp is not None:
                diff = old_logp[i, t].item() - sampling_logp[i, t].item()
                raw = math.exp(diff)
                w = min(raw, is_cap)
                weights.append(w)
                capped.append(1.0 if raw > is_cap else 0.0)
                mismatch.append(abs(diff))
            if ref_logp is not None:
                d = ref_logp[i, t] - logp[i, t]
                k3 = torch.exp(d) - d - 1.0
                kls.append(ref_k3_float(d.item()))
            else:
                k3 = 0.0
                kls.append(0.0)
            ratios.append(rv)
            clipped_flags.append(1.0 if is_clipped else 0.0)
            surrogates.append(w * surrogate.item())
            terms.append(w * surrogate - beta * k3)
        rows.append(terms)
    zero = logp.sum() * 0.0  # a 0 that keeps the graph when there are no terms
    if aggregation == "sequence":
        total = zero + sum(sum(ts) / len(ts) for ts in rows if ts)
        count = sum(1 for ts in rows if ts) if denominator is None else denominator
        loss = -total / max(count, 1) if count else -total
    elif aggregation == "token":
        total = zero + sum(x for ts in rows for x in ts)
        count = len(ratios) if denominator is None else denominator
        loss = -total / count if count else -total
    else:
        total = zero + sum(x for ts in rows for x in ts)
        count = n if denominator is None else denominator
        loss = -total / (count * l_max) if count else -total / l_max
    ntok = len(ratios)
    stats = {
        "kl": math.fsum(kls) / ntok,
        "clip_fraction": math.fsum(clipped_flags) / ntok,
        "ratio_mean": math.fsum(ratios) / ntok,
        "policy_loss": -math.fsum(surrogates) / ntok,
    }
    if sampling_logp is not None:
        stats["is_weight_mean"] = math.fsum(weights) / ntok
        stats["is_capped_frac"] = math.fsum(capped) / ntok
        stats["logp_mismatch"] = math.fsum(mismatch) / ntok
    return loss, stats


def random_variant_inputs(seed, per_token_adv, empty_row):
    logp, old, ref, adv, mask = random_grpo_inputs(seed, per_token_adv)
    gen = torch.Generator().manual_seed(6000 + seed)
    # engine log-probs off by up to ~2 nats, so some weights exceed the cap of 2 and some are < 1
    sampling = old + 0.8 * torch.randn(logp.shape, generator=gen, dtype=F64)
    if empty_row and mask.shape[0] > 1:
        mask = mask.clone()
        mask[-1] = 0.0
    return logp, old, ref, adv, mask, sampling


@pytest.mark.parametrize("seed", list(range(6)))
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
@pytest.mark.parametrize("tis", [False, True])
def test_grpo_loss_variants_match_reference(seed, per_token_adv, aggregation, importance_level, tis):
    logp0, old, ref, adv, mask, sampling = random_variant_inputs(seed, per_token_adv, empty_row=seed % 2 == 1)
    beta = [0.0, 0.04, 0.5][seed % 3]
    if importance_level == "sequence" and seed % 3 == 2:
        clip_eps, clip_eps_high = 3e-4, 4e-4  # GSPO's typical range
    else:
        clip_eps, clip_eps_high = [0.2, 0.1][seed % 2], [None, 0.28][seed % 2]
    is_cap = [None, 2.0, 1.5][seed % 3]
    l_max = mask.shape[1] + seed % 3
    kw = dict(clip_eps=clip_eps, beta=beta, clip_eps_high=clip_eps_high, aggregation=aggregation,
              max_completion_length=l_max, importance_level=importance_level)
    if tis:
        kw.update(sampling_logp=sampling, is_cap=is_cap)

    logp = logp0.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, ref, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)

    logp_r = logp0.clone().requires_grad_()
    e_loss, e_stats = ref_grpo_variants(
        logp_r, old, ref, adv, mask, clip_eps, beta, clip_eps_high, aggregation, l_max=l_max,
        importance_level=importance_level, sampling_logp=sampling if tis else None,
        is_cap=2.0 if is_cap is None else is_cap,
    )
    (e_grad,) = torch.autograd.grad(e_loss, logp_r)

    assert loss.dtype == F64 and loss.dim() == 0
    assert_close(loss, e_loss.detach())
    assert_close(grad, e_grad)
    assert torch.isfinite(grad).all()
    assert (grad[mask == 0] == 0).all()
    for key, value in e_stats.items():
        assert_close(stats[key], value)
    assert set(stats) == {"kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean",
                          "policy_loss", "tokens"} | ({"is_weight_mean", "is_capped_frac", "logp_mismatch"} if tis else set())
    for v in stats.values():
        assert not v.requires_grad


@pytest.mark.parametrize("seed", list(range(4)))
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
def test_grpo_loss_external_denominator_matches_reference(seed, aggregation, importance_level):
    logp0, old, ref, adv, mask, sampling = random_variant_inputs(seed, per_token_adv=seed % 2 == 0, empty_row=True)
    denominator = 3.5 + seed  # any positive count, e.g. a larger step's or one scaled for averaging wrappers
    kw = dict(beta=0.04, aggregation=aggregation, max_completion_length=12, importance_level=importance_level)
    logp = logp0.clone().requires_grad_()
    loss, _ = grpo_loss(logp, old, ref, adv, mask, sampling_logp=sampling, denominator=denominator, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_r = logp0.clone().requires_grad_()
    e_loss, _ = ref_grpo_variants(logp_r, old, ref, adv, mask, 0.2, 0.04, None, aggregation, l_max=12,
                                  importance_level=importance_level, sampling_logp=sampling, denominator=denominator)
    (e_grad,) = torch.autograd.grad(e_loss, logp_r)
    assert_close(loss, e_loss.detach())
    assert_close(grad, e_grad)


@pytest.mark.parametrize("seed", list(range(6)))
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("importance_level", ["token", "sequence"])
def test_micro_batches_with_global_denominator_equal_full_batch(seed, aggregation, importance_level):
    # Split the rows into pieces (micro-batches, or the shares of W processes); each piece
    # back-propagates sum_local / global count. The summed losses and gradients must equal the
    # whole batch's, to float precision.
    rng = random.Random(7000 + seed)
    logp0, old, ref, adv, mask, sampling = random_variant_inputs(seed, per_token_adv=seed % 2 == 0, empty_row=True)
    n = logp0.shape[0]
    cuts = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(1, 3)))) if n > 1 else []
    bounds = [0] + cuts + [n]
    kw = dict(beta=0.04, clip_eps_high=0.28, aggregation=aggregation, max_completion_length=11,
              importance_level=importance_level)

    logp = logp0.clone().requires_grad_()
    full, _ = grpo_loss(logp, old, ref, adv, mask, sampling_logp=sampling, **kw)
    (full_grad,) = torch.autograd.grad(full, logp)

    global_count = sum(loss_denominator(mask[a:b], aggregation) for a, b in zip(bounds, bounds[1:]))
    assert global_count == loss_denominator(mask, aggregation)
    logp_p = logp0.clone().requires_grad_()
    pieces = [
        grpo_loss(logp_p[a:b], old[a:b], ref[a:b], adv[a:b], mask[a:b], sampling_logp=sampling[a:b],
                  denominator=global_count, **kw)[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    total = sum(pieces)
    (piece_grad,) = torch.autograd.grad(total, logp_p)
    assert_close(total, full.detach())
    assert_close(piece_grad, full_grad)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_grpo_loss_gspo_tis_gradcheck(aggregation, per_token_adv):
    gen = torch.Generator().manual_seed(23)
    n, t_len = 3, 4
    mask = prefix_mask([4, 1, 3], t_len)
    old = -torch.rand(n, t_len, generator=gen, dtype=F64) * 3
    # per-row mean log-ratios 0.5, -0.45, 0.05 put s_i at 1.65 (> 1.2), 0.64 (< 0.8) and 1.05 (inside)
    lr = 0.2 * torch.randn(n, t_len, generator=gen, dtype=F64)
    lr = lr - (lr * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True) + t64_col([0.5, -0.45, 0.05])
    s = ((lr * mask).sum(1) / mask.sum(1)).exp()
    assert s[0] > 1.2 + 0.1 and s[1] < 0.8 - 0.1 and 0.8 + 0.1 < s[2] < 1.2 - 0.1  # all regimes, off the kinks
    logp = (old + lr).requires_grad_()
    ref = (logp.detach() + 0.5 * torch.randn(n, t_len, generator=gen, dtype=F64)).requires_grad_()
    sampling = old + 0.8 * torch.randn(n, t_len, generator=gen, dtype=F64)
    shape = (n, t_len) if per_token_adv else (n,)
    a = torch.randn(shape, generator=gen, dtype=F64)
    adv = torch.where(a.abs() < 0.1, a + 0.3 * a.sign() + 0.2, a).requires_grad_()

    def f(lp, rf, ad):
        return grpo_loss(lp, old, rf, ad, mask, beta=0.1, aggregation=aggregation, max_completion_length=5,
                         importance_level="sequence", sampling_logp=sampling)[0]

    assert torch.autograd.gradcheck(f, (logp, ref, adv), eps=1e-6, atol=1e-8, rtol=1e-6)


def t64_col(values):
    return torch.tensor(values, dtype=F64).unsqueeze(1)
