"""Between/within decomposition (docs/probes.md 9): closed forms against a direct ANOVA and the GNS unit level,
and the oracle of issue 40 item 3: on synthetic per-completion gradients with known S_b and S_w the estimates
are unbiased, and their spread is the Gaussian variance of 9.3, across B, K and dimensions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rl_training.probes.advisor import FAR_EFFICIENCY, SplitCosts, advise
from rl_training.probes.anova import AnovaEstimate, AnovaState, GroupGradSums, nested_anova
from rl_training.probes.gns import SmallBatchSums, two_batch_estimate


def sums_of(g: np.ndarray) -> tuple[GroupGradSums, float]:
    """g [B, K, d] per-completion gradients -> the group sums and Q = |gbar|^2."""
    n_b, k, _ = g.shape
    gbar_i = g.mean(1)
    sums = GroupGradSums.balanced(float((g**2).sum()), float((gbar_i**2).sum()), n_b, k)
    return sums, float((gbar_i.mean(0) ** 2).sum())


def test_closed_forms_against_a_direct_anova():
    g = np.random.default_rng(0).standard_normal((5, 4, 7)) + 0.3
    n_b, k, _ = g.shape
    est = nested_anova(*sums_of(g))
    gbar_i, gbar = g.mean(1), g.mean((0, 1))
    ms_w = ((g - gbar_i[:, None]) ** 2).sum() / (n_b * (k - 1))  # within mean square
    ms_b = k * ((gbar_i - gbar) ** 2).sum() / (n_b - 1)  # between mean square: E = tr S_w + K tr S_b
    assert est.trace_within == pytest.approx(ms_w, rel=1e-12)
    assert est.trace_between == pytest.approx((ms_b - ms_w) / k, rel=1e-12)
    assert est.trace_group == pytest.approx(ms_b / k, rel=1e-12)
    # |G|^2 = sum_{i != i'} gbar_i . gbar_i' / (B (B - 1)), the U-statistic over groups
    gram = gbar_i @ gbar_i.T
    assert est.grad_sq_norm == pytest.approx((gram.sum() - np.trace(gram)) / (n_b * (n_b - 1)), rel=1e-12)


def test_group_noise_and_signal_equal_the_gns_unit_level():
    # the GNS unit level (b = 1, c = 1/B) sees the group gradients gbar_i: the same tr Sigma_g and |G|^2
    g = np.random.default_rng(1).standard_normal((6, 3, 9)) + 0.2
    sums, q = sums_of(g)
    est = nested_anova(sums, q)
    n_b = g.shape[0]
    gns = two_batch_estimate(SmallBatchSums(sums.group_sq_norm_over_size / g.shape[1], n_b, n_b, n_b / n_b**2), q)
    assert est.trace_group == pytest.approx(gns.trace_sigma, rel=1e-12)
    assert est.grad_sq_norm == pytest.approx(gns.grad_sq_norm, rel=1e-12)


def test_sums_add_over_ranks():
    g = np.random.default_rng(2).standard_normal((6, 3, 4))
    whole, q = sums_of(g)
    parts = sums_of(g[:2])[0] + sums_of(g[2:])[0]  # rank 0 holds 2 groups, rank 1 holds 4
    a, b = nested_anova(parts, q), nested_anova(whole, q)
    for f in ("trace_between", "trace_within", "grad_sq_norm", "trace_group", "groups"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-12)
    assert nested_anova(GroupGradSums.balanced(1.0, 1.0, 1, 3), 1.0) is None  # B = 1
    assert nested_anova(GroupGradSums.balanced(1.0, 1.0, 4, 1), 1.0) is None  # K = 1
    assert nested_anova(GroupGradSums.balanced(math.inf, 1.0, 4, 2), 1.0) is None


def test_identical_completions_have_no_within_noise():
    # every completion of a group equal to its group's gradient: tr S_w = 0 exactly (M1 = M2)
    base = np.random.default_rng(3).standard_normal((4, 1, 5))
    est = nested_anova(*sums_of(np.repeat(base, 6, axis=1)))
    assert est.trace_within == pytest.approx(0.0, abs=1e-14)
    assert est.trace_between == pytest.approx(est.trace_group, rel=1e-12)


# ------------------------------------------------------------------------------------------- the oracle
def gaussian_variances(lam_b: np.ndarray, lam_w: np.ndarray, g: np.ndarray, n_b: int, k: int) -> dict[str, float]:
    """Exact per-step variances for g_ij = G + b_i + e_ij, b ~ N(0, diag lam_b), e ~ N(0, diag lam_w)
    (docs/probes.md 9.3): SS_w ~ sum_l lam_w,l chi2_{B(K-1)}, the group means' SS ~ sum_l s_l chi2_{B-1} with
    s = lam_b + lam_w/K, independent of SS_w and of gbar ~ N(G, diag s / B)."""
    s = lam_b + lam_w / k
    v_w = 2 * (lam_w**2).sum() / (n_b * (k - 1))
    v_g = 2 * (s**2).sum() / (n_b - 1)
    return {
        "trace_within": v_w,
        "trace_between": v_g + v_w / k**2,
        "grad_sq_norm": 4 * (g**2 * s).sum() / n_b + 2 * (s**2).sum() / (n_b * (n_b - 1)),
    }


def simulate(n_b: int, k: int, d: int, reps: int, seed: int, chunk: int = 250):
    """Per-replication estimates (and the naive within estimate M1 - M2, without K/(K-1)) on Gaussian
    gradients with anisotropic S_b = diag(lam_b), S_w = diag(lam_w) (tr S_b = 1, tr S_w = 4), |G|^2 = 1."""
    rng = np.random.default_rng(seed)
    i = np.arange(1, d + 1)
    lam_b = (1 / i) / (1 / i).sum()
    lam_w = 4 * i / i.sum()
    g_true = np.full(d, 1 / math.sqrt(d))
    rows = []
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        b = np.sqrt(lam_b) * rng.standard_normal((r, n_b, 1, d))
        e = np.sqrt(lam_w) * rng.standard_normal((r, n_b, k, d))
        g = g_true + b + e
        for x in g:
            sums, q = sums_of(x)
            est = nested_anova(sums, q)
            naive = sums.completion_sq_norm_sum / (n_b * k) - sums.group_sq_norm_over_size / (n_b * k)
            rows.append((est.trace_between, est.trace_within, est.grad_sq_norm, naive))
    return np.array(rows), gaussian_variances(lam_b, lam_w, g_true, n_b, k)


CASES = [(2, 2, 1), (4, 3, 5), (16, 8, 64), (3, 16, 10), (32, 2, 8)]  # (B, K, dimensions)


@pytest.mark.parametrize("n_b, k, d", CASES)
def test_oracle_unbiased_with_the_derived_spread(n_b, k, d):
    # 2000 replications. Unbiased: |mean - truth| < 4 sd of the mean, sd = sqrt(Var/R) with Var from 9.3
    # (a false failure has probability 6e-5 per quantity). The spread: the sample variance over R replications
    # has relative sd sqrt((m4/var^2 - 1)/R) (measured kurtosis; about 3-6% here); within 4 of those of 9.3.
    reps = 2000
    x, var = simulate(n_b, k, d, reps, seed=100 * n_b + 10 * k + d)
    for col, (name, truth) in enumerate((("trace_between", 1.0), ("trace_within", 4.0), ("grad_sq_norm", 1.0))):
        v = x[:, col]
        assert abs(v.mean() - truth) < 4 * math.sqrt(var[name] / reps), (name, v.mean(), truth)
        dev = v - v.mean()
        rel_sd = math.sqrt(((dev**4).mean() / (dev**2).mean() ** 2 - 1) / reps)
        assert abs(v.var(ddof=1) / var[name] - 1) < 4 * rel_sd, (name, v.var(ddof=1), var[name])
    # Negative control: treating completions as if no K/(K-1) correction were needed biases tr S_w by -1/K
    # (-50% at K = 2, -6% at K = 16); the same tolerance rejects it, so the test has the power it claims.
    naive = x[:, 3]
    assert abs(naive.mean() - 4.0) > 4 * math.sqrt(var["trace_within"] * ((k - 1) / k) ** 2 / reps)


def unequal_sums(g_groups: list[np.ndarray]) -> tuple[GroupGradSums, float]:
    """Per-completion gradients of groups of any sizes ([k_i, d] each) -> the group sums and Q = |gbar|^2."""
    g = np.concatenate(g_groups)
    sums = GroupGradSums(
        float((g**2).sum()),
        sum(float((x.sum(0) ** 2).sum()) / len(x) for x in g_groups),
        len(g_groups),
        len(g),
        sum(len(x) ** 2 for x in g_groups),
    )
    return sums, float((g.mean(0) ** 2).sum())


@pytest.mark.parametrize("sizes", [(1, 3, 2), (2, 5), (4, 1, 1, 2)])
def test_unequal_groups_are_unbiased_exactly_over_every_sign(sizes):
    # An exact expectation, no sampling: b_i = s_i u and e_ij = t_ij v with independent signs s, t = +-1 give
    # Cov(b_i) = u u^T and Cov(e_ij) = v v^T (tr S_b = |u|^2 = 2.25, tr S_w = |v|^2 = 0.58), zero means,
    # uncorrelated; the mean of each estimate over all 2^(B + N) sign patterns is its expectation, which must be
    # the truth. (u, v, G in 2 dimensions, not orthogonal: the cross terms' expectation is 0 too.)
    u, v, big = np.array([1.5, 0.0]), np.array([0.3, 0.7]), np.array([0.4, -0.2])
    n_b, n = len(sizes), sum(sizes)
    means = np.zeros(3)
    for bits in itertools.product((-1.0, 1.0), repeat=n_b + n):
        s, t = bits[:n_b], iter(bits[n_b:])
        groups = [np.stack([big + s[i] * u + next(t) * v for _ in range(k)]) for i, k in enumerate(sizes)]
        est = nested_anova(*unequal_sums(groups))
        means += [est.trace_between, est.trace_within, est.grad_sq_norm]
    means /= 2 ** (n_b + n)
    assert means == pytest.approx([2.25, 0.58, 0.2], abs=1e-12)


def test_unequal_sums_reduce_to_the_balanced_ones_and_add_over_ranks():
    g = np.random.default_rng(3).standard_normal((5, 3, 4)) + 0.2
    balanced, q = sums_of(g)
    general, q2 = unequal_sums(list(g))
    assert q2 == pytest.approx(q, rel=1e-12)
    a, b = nested_anova(balanced, q), nested_anova(general, q)
    for f in ("trace_between", "trace_within", "grad_sq_norm", "trace_group", "groups", "k"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-12)
    # unequal groups on two ranks: the sums add
    groups = [g[0, :1], g[1], g[2, :2], g[3, :1], g[4]]
    whole, q = unequal_sums(groups)
    parts = unequal_sums(groups[:2])[0] + unequal_sums(groups[2:])[0]
    x, y = nested_anova(parts, q), nested_anova(whole, q)
    assert (x.trace_between, x.trace_within, x.grad_sq_norm) == pytest.approx(
        (y.trace_between, y.trace_within, y.grad_sq_norm), rel=1e-12
    )
    assert nested_anova(unequal_sums([g[0, :1], g[1, :1], g[2, :1]])[0], q) is None  # no group of two: no S_w


# ------------------------------------------------------------------------------------------- the state
def est(sb: float, sw: float, g2: float) -> AnovaEstimate:
    return AnovaEstimate(sb, sw, g2, sb + sw / 4, 8, 4)


def test_state_constant_input_and_bias_correction():
    # bias-corrected EMA of a constant is the constant from the first update; no spread, so SE = 0
    st = AnovaState(beta=0.9)
    for _ in range(5):
        st.update(est(1.5, 6.0, 0.25))
    assert st.estimate == pytest.approx({"trace_between": 1.5, "trace_within": 6.0, "grad_sq_norm": 0.25})
    assert st.se["trace_within"] == pytest.approx(0.0, abs=1e-7) and st.ratio == pytest.approx(4.0)
    # two alternating values 0 and 2 at beta 0 would be the last one; at beta 0.5 after (0, 2): weights
    # 0.5 * 0.5 = 0.25 on 0 and 0.5 on 2, over 1 - 0.25 = 0.75: mean 4/3
    st = AnovaState(beta=0.5)
    st.update(est(0.0, 1.0, 1.0))
    st.update(est(2.0, 1.0, 1.0))
    assert st.estimate["trace_between"] == pytest.approx(4 / 3, rel=1e-12)
    st.update(None)
    assert st.skipped == 1 and st.t == 2


def run_state(seed: int, steps: int, n_b: int = 8, k: int = 4, d: int = 6, beta: float = 0.95, sb_scale=1.0):
    rng = np.random.default_rng(seed)
    st = AnovaState(beta=beta)
    lam_b, lam_w = np.full(d, sb_scale / d), np.full(d, 4 / d)
    for _ in range(steps):
        g = 1 / math.sqrt(d) + np.sqrt(lam_b) * rng.standard_normal((n_b, 1, d))
        g = g + np.sqrt(lam_w) * rng.standard_normal((n_b, k, d))
        st.update(nested_anova(*sums_of(g)))
    return st


def test_state_standard_error_is_calibrated():
    # 200 seeds x 150 steps: |EMA - truth| <= 2 SE for 85-99% of the seeds, per quantity (nominal 95.4%)
    hits = np.zeros(3)
    for seed in range(200):
        st = run_state(seed, 150)
        e, se = st.estimate, st.se
        hits += [abs(e[q] - t) <= 2 * se[q] for q, t in zip(e, (1.0, 4.0, 1.0), strict=True)]
    assert all(0.85 <= h / 200 <= 0.99 for h in hits), hits / 200


def test_state_trust_and_ratio_band():
    # Strong between-prompt noise (tr S_b = 1, S_w/S_b = 4): trusted once past warm-up + lag, and the band
    # holds 4. No between-prompt noise (tr S_b = 0): the band runs to inf, never trusted.
    st = run_state(7, 200)
    lo, hi = st.ratio_band
    assert st.trusted and lo <= 4.0 <= hi and math.isfinite(hi)
    st0 = run_state(8, 200, sb_scale=0.0)
    assert not st0.trusted and st0.ratio_band[1] == math.inf
    # the gate waits for the warm-up, 3/(1 - beta) = 60 updates (the band was already bounded 39 updates back)
    assert not run_state(7, 59).trusted and run_state(7, 60).trusted


def test_state_dict_round_trip_and_beta_change():
    st = run_state(9, 30)
    other = AnovaState(beta=0.95)
    assert other.load_state_dict(st.state_dict())
    nxt = est(0.5, 3.0, 0.8)
    st.update(nxt)
    other.update(nxt)
    assert other.estimate == st.estimate and other.se == st.se and other.bounded == st.bounded
    fresh = AnovaState(beta=0.9)
    assert not fresh.load_state_dict(st.state_dict())
    assert fresh.t == 0 and fresh.beta == 0.9 and fresh.skipped == st.skipped


def test_from_the_anova_state_to_the_advice():
    # Synthetic steps (run_state: B = 8, K = 4, tr S_w = 4, tr S_b = 0.25,
    # |G|^2 = 1) through nested_anova and AnovaState, then advise with c_p/c_r = 4: the true K* is
    # sqrt(4 * 16) = 8. After 400 steps the state is trusted, the K* band holds 8, and the current K = 4 is
    # not flagged (f(4)/f(8) = (1 + 4)(8) / ((1 + 2)(12)) = 1.11: efficiency 0.9 > 0.8).
    st = run_state(11, 400, sb_scale=0.25)
    a = advise(st.estimate, st.ratio_band, st.trusted, SplitCosts(4.0, 1.0), current_k=4, completions_per_step=32)
    assert a.trusted and a.k_lo <= 8 <= a.k_hi and 5 <= a.k_star <= 12, a
    assert not a.far and a.efficiency > FAR_EFFICIENCY
