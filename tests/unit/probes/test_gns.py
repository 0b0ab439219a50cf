"""GNS estimator oracles of docs/probes.md section 3: closed forms (T2), invariances and
negative controls (T4, T5), and the statistical oracles S1-S3 with fixed seeds."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from rl_training.probes.capture import MicroGradCapture
from rl_training.probes.dashboard import batch_alert
from rl_training.probes.gns import (
    GNSState,
    RawEstimate,
    SmallBatchSums,
    ema_n_eff,
    fieller_band,
    recommend_batch,
    two_batch_estimate,
)

D = torch.float64


def sums_from_small(grads: list[torch.Tensor], b: list[int], c: list[float]) -> SmallBatchSums:
    return SmallBatchSums(
        sum(g.pow(2).sum().item() for g in grads),
        len(grads),
        sum(1 / x for x in b),
        sum(ci * ci / bi for ci, bi in zip(c, b, strict=True)),
    )


def estimate_from_units(units: torch.Tensor, b: int):
    """units [n, d] per-unit gradients split into consecutive micro-batches of b; G_B = their mean."""
    n = units.shape[0]
    micro = [units[i : i + b].mean(0) for i in range(0, n, b)]
    sums = sums_from_small(micro, [b] * len(micro), [b / n] * len(micro))
    return two_batch_estimate(sums, units.mean(0).pow(2).sum().item()), micro


# ----------------------------------------------------------------------------------------------- T2
def test_closed_forms_unit_level():
    g = torch.randn(10, 7, generator=torch.Generator().manual_seed(0), dtype=D)
    est, _ = estimate_from_units(g, 1)
    n, mean = g.shape[0], g.mean(0)
    # trSigma_est = sum_j |g_j - mean|^2 / (n - 1): the unbiased sample covariance trace
    assert est.trace_sigma == pytest.approx(((g - mean) ** 2).sum().item() / (n - 1), rel=1e-12)
    # |G|^2_est = sum_{j != k} g_j . g_k / (n (n - 1)): a U-statistic
    gram = g @ g.T
    assert est.grad_sq_norm == pytest.approx((gram.sum() - gram.diag().sum()).item() / (n * (n - 1)), rel=1e-12)


def test_closed_forms_micro_level_and_paper_formulas():
    g = torch.randn(24, 5, generator=torch.Generator().manual_seed(1), dtype=D)
    b, n = 4, 24
    est, micro = estimate_from_units(g, b)
    m = torch.stack(micro)
    # trSigma_est = b * Bessel sample variance of the micro means
    assert est.trace_sigma == pytest.approx(b * ((m - m.mean(0)) ** 2).sum().item() / (len(micro) - 1), rel=1e-12)
    # McCandlish App. A.1 with B_small = b, B_big = n
    s_small = (m**2).sum(1).mean().item()
    q = g.mean(0).pow(2).sum().item()
    assert est.grad_sq_norm == pytest.approx((n * q - b * s_small) / (n - b), rel=1e-12)
    assert est.trace_sigma == pytest.approx((s_small - q) / (1 / b - 1 / n), rel=1e-12)


def test_estimator_inverts_the_expectations_symbolically():
    sympy = pytest.importorskip("sympy")
    g2, tr, a, beta = sympy.symbols("G2 T a beta", positive=True)
    s_bar, q = g2 + a * tr, g2 + beta * tr  # E[S] and E[Q] (docs/probes.md 1.3)
    assert sympy.simplify((s_bar - q) / (a - beta) - tr) == 0
    assert sympy.simplify((a * q - beta * s_bar) / (a - beta) - g2) == 0


def test_not_identifiable_cases():
    assert two_batch_estimate(SmallBatchSums(1.0, 1, 1.0, 1.0), 1.0) is None  # K = 1
    assert two_batch_estimate(SmallBatchSums(2.0, 2, 2.0, 1.0), 1.0) is None  # a == beta
    assert two_batch_estimate(SmallBatchSums(float("inf"), 2, 2.0, 0.5), 1.0) is None


# ------------------------------------------------------------------------------------------ T4 / T5
def test_loss_scale_scales_raw_estimates_by_c_squared_and_keeps_b_simple():
    g = torch.randn(16, 9, generator=torch.Generator().manual_seed(2), dtype=D) + 0.5
    e1, _ = estimate_from_units(g, 4)
    e3, _ = estimate_from_units(3.0 * g, 4)
    assert e3.trace_sigma == pytest.approx(9 * e1.trace_sigma, rel=1e-12)
    assert e3.grad_sq_norm == pytest.approx(9 * e1.grad_sq_norm, rel=1e-12)
    assert e3.trace_sigma / e3.grad_sq_norm == pytest.approx(e1.trace_sigma / e1.grad_sq_norm, rel=1e-12)


def test_permuting_units_changes_nothing_at_unit_level():
    g = torch.randn(12, 4, generator=torch.Generator().manual_seed(3), dtype=D)
    e1, _ = estimate_from_units(g, 1)
    e2, _ = estimate_from_units(g[torch.randperm(12, generator=torch.Generator().manual_seed(9))], 1)
    assert e2.trace_sigma == pytest.approx(e1.trace_sigma, rel=1e-12)
    assert e2.grad_sq_norm == pytest.approx(e1.grad_sq_norm, rel=1e-12)


def test_identical_unit_gradients_give_zero_noise():
    # Random identical vectors over many seeds and shapes: S - Q is round-off (~1e-16 S, either sign), so
    # trSigma_ema can be slightly negative; it must read as B_simple = 0 (valid), never NaN. Before the
    # round-off tolerance 50 of these 200 cases gave NaN.
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        d, b, k = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 300), (1, 9), (2, 17)))
        g = torch.randn(d, generator=gen, dtype=D).expand(b * k, d)
        est, _ = estimate_from_units(g, b)
        assert abs(est.trace_sigma) <= 1e-12 * est.s_bar
        st = GNSState(beta=0.9)
        st.update(est)
        st.update(est)
        assert st.valid and st.b_simple == pytest.approx(0.0, abs=1e-10), (seed, d, b, k)


def test_clearly_negative_trace_sigma_is_still_invalid():
    # The tolerance is round-off only: a noise estimate of -1% of the per-step scale stays NaN.
    st = GNSState(beta=0.9)
    st.update(RawEstimate(trace_sigma=-0.01, grad_sq_norm=1.0, s_bar=1.0, q=1.0, a=1.0, beta=0.0, k=2))
    assert not st.valid and math.isnan(st.b_simple)


def test_window_sum_mode_resets_every_r_steps():
    # window R = 3: after 5 updates the state holds only updates 4 and 5 (plain sums, N_eff = 2).
    ests = [RawEstimate(float(i), 1.0 + i, 1.0, 1.0, 1.0, 0.0, 2) for i in range(1, 6)]
    st = GNSState(window=3)
    for e in ests[:3]:
        st.update(e)
    assert st.b_simple == pytest.approx((1 + 2 + 3) / (2 + 3 + 4), rel=1e-15) and st.n_eff == 3
    for e in ests[3:]:
        st.update(e)
    assert st.b_simple == pytest.approx((4 + 5) / (5 + 6), rel=1e-15) and st.n_eff == 2
    assert st.trace_sigma == pytest.approx(4.5) and st.grad_sq_norm == pytest.approx(5.5)


def test_pure_noise_toggles_validity_without_nan():
    gen = torch.Generator().manual_seed(4)
    st, seen_valid, seen_invalid = GNSState(beta=0.5), False, False
    for _ in range(200):
        est, _ = estimate_from_units(torch.randn(16, 32, generator=gen, dtype=D), 4)  # G = 0
        st.update(est)
        seen_valid |= st.valid
        seen_invalid |= not st.valid
        for v in (st.trace_sigma, st.grad_sq_norm):
            assert math.isfinite(v)
        assert st.valid or math.isnan(st.b_simple)  # shown as NaN, never a clamped huge value
    assert seen_valid and seen_invalid
    assert abs(st.grad_sq_norm) < 0.5 * st.trace_sigma / 16  # |G|^2_ema fluctuates around 0


def test_non_finite_step_is_skipped_and_counted():
    g = torch.randn(8, 4, generator=torch.Generator().manual_seed(5), dtype=D) + 1
    st = GNSState(beta=0.9)
    st.update(estimate_from_units(g, 2)[0])
    before = (st.t, st.m_tr, st.m_g2)
    st.update(two_batch_estimate(SmallBatchSums(float("nan"), 4, 2.0, 0.125), 1.0))
    assert (st.t, st.m_tr, st.m_g2) == before and st.skipped == 1


def test_ema_n_eff_values():
    # (1-b^t)^2 (1+b) / ((1-b)(1-b^2t)): t=1 -> 1; t -> inf -> (1+b)/(1-b) = 39 for b = 0.95
    assert ema_n_eff(0.95, 1) == pytest.approx(1.0)
    assert ema_n_eff(0.95, 10_000) == pytest.approx(39.0, rel=1e-9)


# ------------------------------------------------------------------------------------ S1: constant gradient
def constant_gradient_units(n: int, gen, mu_sq: float, L: int = 256) -> torch.Tensor:
    """u_j ~ N(mu, I_L) with |mu|^2 = mu_sq: gamma_j = -u_j e^T, so trSigma = L and |G|^2 = mu_sq."""
    mu = torch.full((L,), math.sqrt(mu_sq / L), dtype=D)
    return mu + torch.randn(n, L, generator=gen, dtype=D)


def run_ratio_of_sums(steps, sizes, mu_sq, seed, state: GNSState | None = None):
    """Feed the estimator small batches of the given sizes per step; return the ratio of summed estimates
    (or `state`'s B_simple, after feeding it every step) and the per-step ratios."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    tr_sum = g2_sum = 0.0
    ratios = []
    for _ in range(steps):
        u = constant_gradient_units(n, gen, mu_sq)
        small, start = [], 0
        for b in sizes:
            small.append(u[start : start + b].mean(0))
            start += b
        est = two_batch_estimate(sums_from_small(small, sizes, [b / n for b in sizes]), u.mean(0).pow(2).sum().item())
        tr_sum += est.trace_sigma
        g2_sum += est.grad_sq_norm
        ratios.append(est.trace_sigma / est.grad_sq_norm)
        if state is not None:
            state.update(est)
    return (state.b_simple if state else tr_sum / g2_sum), ratios, state


def ema_of_ratios(ratios: list[float], beta: float) -> float:
    """The wrong smoothing (an EMA of per-step ratios), to show that the oracles below can catch it."""
    m = 0.0
    for r in ratios:
        m = beta * m + (1 - beta) * r
    return m / (1 - beta ** len(ratios))


def test_s1_micro_ratio_of_sums():  # simulated rel. error sd 1.9% -> assert < 10%
    bs, _, _ = run_ratio_of_sums(200, [4] * 8, 4.0, seed=10)
    assert abs(bs / 64 - 1) < 0.10


def test_s1_micro_ema():  # EMA beta 0.99 over 500 steps, sd 1.9% -> < 10%; also the numerator and denominator
    bs, _, st = run_ratio_of_sums(500, [4] * 8, 4.0, seed=11, state=GNSState(beta=0.99))
    assert abs(bs / 64 - 1) < 0.10
    assert abs(st.trace_sigma / 256 - 1) < 0.05 and abs(st.grad_sq_norm / 4 - 1) < 0.15


def test_s1_ema_is_not_an_ema_of_ratios():
    # One seed cannot separate the two: simulated over 40 seeds, the EMA of sums (beta 0.99, 500 steps) has
    # rel. error mean -0.3%, sd 2.0%; an EMA of per-step ratios has mean +8.5%, sd 2.5% (range +2.3..+14.5%).
    # Averaged over 8 seeds: sd 0.7% vs 0.9%, so |mean error| < 4% passes the right smoothing by > 5 sd and
    # fails the EMA of ratios by ~5 sd. Both are computed on the same draws.
    errs, wrong = [], []
    for seed in range(100, 108):
        bs, ratios, _ = run_ratio_of_sums(500, [4] * 8, 4.0, seed=seed, state=GNSState(beta=0.99))
        errs.append(bs / 64 - 1)
        wrong.append(ema_of_ratios(ratios, 0.99) / 64 - 1)
    assert abs(sum(errs) / len(errs)) < 0.04
    assert abs(sum(wrong) / len(wrong)) > 0.04


def test_s1_unit_level():  # b = 1, K = 32, 50 steps, sd 3.8% -> < 15%
    bs, _, _ = run_ratio_of_sums(50, [1] * 32, 4.0, seed=12)
    assert abs(bs / 64 - 1) < 0.15


def test_s1_unequal_micro_sizes():  # (2,3,5,6,8,4,1,3), 200 steps, sd 2.0% -> < 12%
    bs, _, _ = run_ratio_of_sums(200, [2, 3, 5, 6, 8, 4, 1, 3], 4.0, seed=13)
    assert abs(bs / 64 - 1) < 0.12


def test_s1_rank_level():  # W = 2 ranks of b = 16, 200 steps, sd 2.5% -> < 12%
    bs, _, _ = run_ratio_of_sums(200, [16, 16], 4.0, seed=14)
    assert abs(bs / 64 - 1) < 0.12


def test_s1_through_real_parameter_hooks():
    """The same oracle, with the small gradients read by MicroGradCapture from real backward passes of
    loss = -<u_j, W e> / B through a trainable Linear (its gradient does not depend on W, so optimizer
    steps would not change the truth)."""
    L, K, B, b = 256, 4, 32, 4
    W = torch.nn.Linear(K, L, bias=False).double()
    e = torch.zeros(K, dtype=D)
    e[0] = 1.0
    cap = MicroGradCapture([W.weight])
    gen = torch.Generator().manual_seed(15)
    tr_sum = g2_sum = 0.0
    for _ in range(200):
        u = constant_gradient_units(B, gen, 4.0)
        W.weight.grad = None
        small = []
        for s in range(0, B, b):
            with cap.capture():
                (-(u[s : s + b] @ W(e)).sum() / B).backward()
            assert cap.calls == 1  # one trainable tensor, one hook call per backward
            small.append(cap.sq_norm.item() * (B / b) ** 2)  # micro increment -> its units' mean gradient
        sums = SmallBatchSums(sum(small), len(small), len(small) / b, len(small) * (b / B) ** 2 / b)
        est = two_batch_estimate(sums, W.weight.grad.pow(2).sum().item())
        tr_sum += est.trace_sigma
        g2_sum += est.grad_sq_norm
    assert abs(tr_sum / g2_sum / 64 - 1) < 0.10


def s1_hook_steps(steps: int, max_norm: float, frozen: bool = False, inf_step: int = -1):
    """S1 through MicroGradCapture with real optimizer steps (SGD lr 0.5) and clipping after the read of Q.
    `frozen` adds a frozen Linear and a no-grad buffer-like parameter to the loss; `inf_step` injects an
    inf into one unit at that step. Returns the raw estimate of every step and the EMA state."""
    L, K, B, b = 256, 4, 32, 4
    torch.manual_seed(0)
    W = torch.nn.Linear(K, L, bias=False).double()
    extra = torch.nn.Linear(K, L, bias=False).double().requires_grad_(False)
    nograd = torch.nn.Parameter(torch.ones(L, dtype=D), requires_grad=False)
    opt = torch.optim.SGD(W.parameters(), lr=0.5)
    e = torch.zeros(K, dtype=D)
    e[0] = 1.0
    cap = MicroGradCapture([W.weight])  # trainable parameters only, as the trainer passes them
    gen = torch.Generator().manual_seed(16)
    st, raw = GNSState(beta=0.9), []
    for step in range(steps):
        u = constant_gradient_units(B, gen, 4.0)
        if step == inf_step:
            u[3, 0] = math.inf
        opt.zero_grad(set_to_none=True)
        small = []
        for s in range(0, B, b):
            with cap.capture():
                out = W(e) + (extra(e) * nograd if frozen else 0.0)
                (-(u[s : s + b] @ out).sum() / B).backward()
            small.append(cap.sq_norm.item() * (B / b) ** 2)
        sums = SmallBatchSums(sum(small), len(small), len(small) / b, len(small) * (b / B) ** 2 / b)
        est = two_batch_estimate(sums, W.weight.grad.pow(2).sum().item())  # Q before clipping
        torch.nn.utils.clip_grad_norm_([W.weight], max_norm)
        opt.step()
        raw.append(est)
        st.update(est)
    cap.remove()
    return raw, st


def test_t4_clipping_and_frozen_params_change_no_step_of_the_s1_estimate():
    # The S1 gradient does not depend on W, so optimizer steps of any size leave the truth unchanged; Q is
    # read before clipping. Clipping to 1e-6 vs no clipping, and extra frozen / no-grad parameters in the
    # loss, must therefore give identical raw estimates at every step (1e-12), not only the first.
    base, st = s1_hook_steps(6, math.inf)
    for variant in (s1_hook_steps(6, 1e-6)[0], s1_hook_steps(6, math.inf, frozen=True)[0]):
        for a, c in zip(base, variant, strict=True):
            assert c.trace_sigma == pytest.approx(a.trace_sigma, rel=1e-12)
            assert c.grad_sq_norm == pytest.approx(a.grad_sq_norm, rel=1e-12)
    assert st.t == 6 and st.skipped == 0


def test_t5_inf_gradient_through_the_hooks_is_skipped_and_the_ema_untouched():
    # An inf in one unit at step 3 makes that step's small and big norms non-finite: no estimate, skipped and
    # counted; steps 0-2 then 4-5 feed the EMA exactly as a run without step 3 would (same draws elsewhere).
    raw, st = s1_hook_steps(6, math.inf, inf_step=3)
    clean, _ = s1_hook_steps(6, math.inf)
    assert raw[3] is None and st.skipped == 1 and st.t == 5
    ref = GNSState(beta=0.9)
    for i in (0, 1, 2, 4, 5):
        ref.update(clean[i])
    assert st.m_tr == pytest.approx(ref.m_tr, rel=1e-12) and st.m_g2 == pytest.approx(ref.m_g2, rel=1e-12)
    assert math.isfinite(st.b_simple)


# --------------------------------------------------------------------------------------- S2, S3
def test_s2_ratio_of_sums_versus_mean_of_ratios():
    # |mu|^2 = 0.25 -> B_simple = 1024 with B = 32: after 2000 steps the ratio of sums has sd 7% (assert < 30%);
    # the mean of per-step ratios is off by > 100% in this regime (what an "EMA of the ratio" would report).
    # Run through GNSState's window-sum mode (one window of 2000 steps), so the code's smoothing is tested.
    bs, ratios, st = run_ratio_of_sums(2000, [4] * 8, 0.25, seed=16, state=GNSState(window=2000))
    tr_sum_ratio, _, _ = run_ratio_of_sums(2000, [4] * 8, 0.25, seed=16)  # the same draws, summed here
    assert st.valid and bs == pytest.approx(tr_sum_ratio, rel=1e-9)
    assert abs(bs / 1024 - 1) < 0.30
    mean_of_ratios = sum(ratios) / len(ratios)
    assert abs(mean_of_ratios / 1024 - 1) > 1.0
    assert abs(bs / mean_of_ratios - 1) > 0.5  # the implementation's value is not the mean of ratios


def test_s3_theta_dependent_truth_linear_regression():
    # x ~ N(0, I_d), y = x.theta* + eps, unit loss 0.5 (x.theta - y)^2 at a frozen theta, delta = theta - theta*:
    # G = delta, Sigma = delta delta^T + (|delta|^2 + s^2) I  ->  B_simple = (d + 1) + d s^2 / |delta|^2.
    d, sigma, b, k = 8, 0.5, 4, 8
    gen = torch.Generator().manual_seed(17)
    theta_star = torch.randn(d, generator=gen, dtype=D)
    delta = torch.full((d,), 0.3, dtype=D)
    theta = theta_star + delta
    truth = (d + 1) + d * sigma**2 / delta.pow(2).sum().item()
    tr_sum = g2_sum = 0.0
    for _ in range(300):
        x = torch.randn(b * k, d, generator=gen, dtype=D)
        y = x @ theta_star + sigma * torch.randn(b * k, generator=gen, dtype=D)
        units = (x @ theta - y).unsqueeze(1) * x  # per-unit gradient (x.theta - y) x
        est, _ = estimate_from_units(units, b)
        tr_sum += est.trace_sigma
        g2_sum += est.grad_sq_norm
    assert abs(tr_sum / g2_sum / truth - 1) < 0.10


# ------------------------------------------------------------------------------------ recommendation
def test_recommendation_waits_and_respects_bounds():
    st = GNSState(beta=0.9)
    assert math.isnan(recommend_batch(st, 16, 4, 4, 256).batch)
    gen = torch.Generator().manual_seed(18)
    for _ in range(60):  # B_simple = 64 with a batch of 16 -> wants 64, capped at 2 x 16 = 32 per change
        st.update(estimate_from_units(constant_gradient_units(64, gen, 4.0), 4)[0])
    rec = recommend_batch(st, 16, 4, 4, 256)
    assert rec.batch == 32.0 and rec.reason == "ok"
    # The nearest point of the band to the current batch (16): inside -> stay; above -> its lower end (20);
    # below -> its upper end (6), clipped to current/2 = 8. An unbounded band above 16 also means "stay".
    assert recommend_batch(st, 16, 4, 4, 256, target_band=(8.0, 24.0)).batch == 16.0
    assert recommend_batch(st, 16, 4, 4, 256, target_band=(20.0, 40.0)).batch == 20.0
    assert recommend_batch(st, 16, 4, 4, 256, target_band=(2.0, 6.0)).batch == 8.0
    assert recommend_batch(st, 16, 4, 4, 256, target_band=(3.0, math.inf)).batch == 16.0


def test_fieller_band_worked_values():
    # tr = 10, g2 = 1, Var(g2) = 0.01, z = 2: a = 1 - 4(0.01) = 0.96, b = 10, c = 100, sqrt(b^2 - ac) = 2:
    # [8/0.96, 12/0.96]; at rho = 12.5, (10 - 12.5)^2 = 6.25 = 4 (12.5^2)(0.01).
    lo, hi = fieller_band(10.0, 1.0, 0.0, 0.01, 0.0)
    assert lo == pytest.approx(8 / 0.96, rel=1e-12) and hi == pytest.approx(12.5, rel=1e-12)
    # g2 = 0.1 is not significant (a = 0.01 - 0.04 < 0): [positive root, inf) with b = 1, sqrt(1 + 3) = 2:
    # lo = (1 - 2)/(-0.03) = 33.3; (10 - 3.33)^2 = 44.4 = 4 (33.3^2)(0.01).
    lo, hi = fieller_band(10.0, 0.1, 0.0, 0.01, 0.0)
    assert lo == pytest.approx(100 / 3, rel=1e-12) and hi == math.inf
    assert all(math.isnan(x) for x in fieller_band(10.0, -1.0, 0.0, 0.01, 0.0))  # g2 significantly < 0
    assert fieller_band(0.1, 1.0, 1.0, 0.01, 0.0)[0] == 0.0  # tr not significantly > 0: lo = 0
    assert fieller_band(0.1, 0.1, 1.0, 0.01, 0.0) == (0.0, math.inf)  # neither: all of [0, inf)
    # With no noise at all the band is the point tr/g2.
    assert fieller_band(6.0, 2.0, 0.0, 0.0, 0.0) == pytest.approx((3.0, 3.0), rel=1e-12)


def test_s4_standard_error_is_calibrated():
    # Across 200 seeds, |B_simple_ema / 64 - 1| <= 2 rel_se should hold for 85-99% of runs (docs/probes.md 3, S4).
    hits = 0
    for seed in range(200):
        bs, _, st = run_ratio_of_sums(150, [4] * 8, 4.0, seed=1000 + seed, state=GNSState(beta=0.95))
        hits += abs(bs / 64 - 1) <= 2 * st.b_simple_rel_se
    assert 0.85 <= hits / 200 <= 0.99


# ------------------------------------------------------------------------- trust rule (docs/probes.md 1.6)
TRUST_SIZES = np.array([2, 3, 5, 6, 8, 4, 1, 3])  # unequal micro-batches, B = 32 prompt groups


@functools.cache
def trust_run(ratio: float, seeds: int = 200, steps: int = 300):
    """B/B_simple = `ratio`: Gaussian small gradients g_k ~ N(G, Sigma/b_k) in L = 8 dimensions with
    anisotropic Sigma = diag(c/i) (d_eff = (tr S)^2/tr S^2 = 4.8: little information per step, the hard case),
    tr Sigma = 8 and |G|^2 = 8 ratio/32, so B_simple = 32/ratio. All seeds drawn at once (numpy), then each
    seed's estimates fed through the real two_batch_estimate and GNSState (beta 0.95). Returns per-step arrays
    [steps, seeds]: band lo, hi, the gate, the batch alert, and the old gate (rel SE <= 0.3 on the point
    estimate, band B_s exp(+-2 SE)) with its band, to show this test can fail."""
    L, B, K = 8, int(TRUST_SIZES.sum()), len(TRUST_SIZES)
    lam = 1 / np.arange(1, L + 1)
    lam *= L / lam.sum()
    truth = B / ratio
    rng = np.random.default_rng(int(1000 * ratio))
    g = np.sqrt(lam.sum() / truth / L) + np.sqrt(lam / TRUST_SIZES[:, None]) * rng.standard_normal((steps, seeds, K, L))
    s_sum = (g**2).sum(axis=(2, 3))  # sum_k |g_k|^2
    q = ((g * (TRUST_SIZES / B)[:, None]).sum(2) ** 2).sum(-1)  # |G_B|^2 with c_k = b_k / B
    sums = dict(k=K, inv_b_sum=(1 / TRUST_SIZES).sum(), c2_over_b_sum=((TRUST_SIZES / B) ** 2 / TRUST_SIZES).sum())
    out = {k: np.empty((steps, seeds)) for k in ("lo", "hi", "gate", "alert", "old_gate", "old_lo", "old_hi")}
    for s in range(seeds):
        st = GNSState(beta=0.95)
        for t in range(steps):
            st.update(two_batch_estimate(SmallBatchSums(s_sum[t, s], **sums), q[t, s]))
            lo, hi = st.band
            bs, se = st.b_simple, st.b_simple_rel_se
            out["lo"][t, s], out["hi"][t, s], out["gate"][t, s] = lo, hi, st.trusted
            out["alert"][t, s] = batch_alert(B, B / bs if st.valid and bs > 0 else math.nan, lo, hi)
            out["old_gate"][t, s] = st.valid and st.valid_steps >= 60 and se <= 0.3
            out["old_lo"][t, s], out["old_hi"][t, s] = bs * math.exp(-2 * min(se, 99)), bs * math.exp(2 * min(se, 99))
    return out, truth


@pytest.mark.parametrize("ratio", [0.04, 0.2, 1.0, 5.0])
def test_recommendation_band_covers_the_truth_whenever_shown(ratio):
    # Nominal coverage of +-2 SE is 95.4%. Measured on these draws: coverage when shown 0.963, 0.956, 0.955,
    # 0.954 at ratios 0.04, 0.2, 1, 5, shown on 3.6%, 32%, 100%, 100% of the steps after the warm-up (the
    # band's upper end is finite at 7% and 38% of the shown steps of 0.04 and 0.2). The old gate, on the same
    # draws, was open on 1.7% of the steps at 0.2 and covered the truth at 3.8% of them, as in the issue. The
    # shown steps of one seed are correlated (the EMA), so a rarely shown regime's coverage has an sd of ~2%.
    out, truth = trust_run(ratio)
    warm = np.arange(out["gate"].shape[0]) >= 60  # 3/(1-beta) updates
    shown = out["gate"].astype(bool) & warm[:, None]
    covered = (out["lo"] <= truth) & (truth <= out["hi"])
    assert shown.sum() >= 500, shown.sum()  # the regime is exercised
    assert 0.88 <= covered[shown].mean() <= 0.995, covered[shown].mean()
    if ratio >= 1:  # a well-measured B_simple is shown nearly always after warm-up + one window
        assert shown[100:].mean() >= 0.97
    old = out["old_gate"].astype(bool)
    old_cov = ((out["old_lo"] <= truth) & (truth <= out["old_hi"]))[old]
    if ratio == 0.2:  # negative control: the old rule opened by luck and then missed the truth
        assert old.sum() > 100 and old_cov.mean() < 0.7, (old.sum(), old_cov.mean())


@pytest.mark.parametrize(
    "ratio, noise_min, noise_max, waste_min",
    [(0.04, 0.85, 1, 0), (0.2, 0.5, 1, 0), (1.0, 0, 0.01, 0), (5.0, 0, 0, 0.9)],
)
def test_batch_alert_fires_where_it_should(ratio, noise_min, noise_max, waste_min):
    # Measured on these draws: noise-dominated alert on 93%, 66%, 0%, 0% of the steps after warm-up at ratios
    # 0.04, 0.2, 1, 5, compute-wasteful on 0, 0, 0, 99.7%. The old rule (rel SE <= 0.3 on the point
    # estimate) fired the noise alert on none of them. A false alarm needs B < lo with lo > truth (<= 2.3%).
    out, _ = trust_run(ratio)
    a = out["alert"][60:]
    assert noise_min <= (a == -1).mean() <= noise_max, (a == -1).mean()
    assert (a == 1).mean() >= waste_min and (ratio >= 4 or (a == 1).mean() == 0)
