"""ESS oracles E1-E6 (docs/probes.md 3) and the log-domain guarantees: no overflow, no exception, and a
defined critical reading for NaN or inf weights (docs/probes.md 1.7)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from rl_training.probes.ess import LogKish, group_ness, kish_of, log_kish, sequence_log_weights, weight_log

D = torch.float64


def sums(w, mask=None) -> LogKish:
    return log_kish(weight_log(torch.as_tensor(w, dtype=D)), None if mask is None else torch.as_tensor(mask))


def ness(w, mask=None):
    return kish_of(sums(w, mask))


def test_e1_uniform_onehot_k_equal_scale_and_cv_identity():
    assert ness([2.0] * 10).ess == pytest.approx(10) and ness([2.0] * 10).ness == pytest.approx(1.0)
    assert ness([0, 0, 5.0, 0]).ess == pytest.approx(1.0)
    assert ness([0, 3, 0, 3, 3, 0]).ess == pytest.approx(3.0)  # k equal non-zero of N -> k
    w = torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=D) + 0.1
    assert ness(7 * w).ess == pytest.approx(ness(w).ess, rel=1e-12)
    cv2 = w.var(unbiased=False) / w.mean() ** 2  # ESS = N / (1 + CV^2), population variance
    assert ness(w).ess == pytest.approx(50 / (1 + cv2.item()), rel=1e-12)


def test_e2_sharded_sums_equal_the_concatenation_not_the_mean_of_shards():
    a = torch.rand(40, generator=torch.Generator().manual_seed(1), dtype=D)
    b = 5 * torch.rand(60, generator=torch.Generator().manual_seed(2), dtype=D) + 2  # different mean
    whole = ness(torch.cat([a, b]))
    summed = kish_of(sums(a) + sums(b))  # rescaled to the larger shift, what the all-reduces give
    assert summed.ess == pytest.approx(whole.ess, rel=1e-12)
    mean_of_shards = (ness(a).ness + ness(b).ness) / 2
    assert abs(mean_of_shards - whole.ness) > 0.01


def test_e3_masking_padding_and_all_zero():
    w = torch.ones(100, dtype=D)
    w[:25] = 0.0  # mask f = 0.25 of uniform weights to 0, N fixed -> ness = 0.75
    assert ness(w).ness == pytest.approx(0.75)
    # Pad tokens (mask 0) are excluded from N.
    assert ness([1.0, 1.0, 9.0, 9.0], mask=[1, 1, 0, 0]).ness == pytest.approx(1.0)
    z = ness(torch.zeros(10, dtype=D))
    assert (z.ess, z.ness, z.defined) == (0.0, 0.0, False)
    z = kish_of(LogKish.empty())  # no items at all
    assert (z.ess, z.ness, z.defined) == (0.0, 0.0, False)


def test_e4_log_domain_sequence_weights():
    # sum_t log rho = +-1000: finite, and one dominant weight gives ESS -> 1
    lw = torch.tensor([1000.0, -1000.0, 0.0], dtype=D)
    r = kish_of(log_kish(lw))
    assert math.isfinite(r.ess) and r.ess == pytest.approx(1.0)
    # moderate values match the naive computation
    log_rho = 0.1 * torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=D)
    mask = torch.ones(6, 5, dtype=D)
    mask[2, 3:] = 0
    l_seq = sequence_log_weights(log_rho, mask)
    w = torch.exp((log_rho * mask).sum(1))
    naive = (w.sum() ** 2 / (w * w).sum()).item()
    assert kish_of(log_kish(l_seq)).ess == pytest.approx(naive, rel=1e-12)


@pytest.mark.parametrize("s2", [0.01, 0.1, 1.0])
def test_e5_lognormal_ness(s2):
    # log w ~ N(-s^2/2, s^2): ness -> exp(-s^2); N = 1e6, within 1%
    g = torch.Generator().manual_seed(4)
    lw = -s2 / 2 + math.sqrt(s2) * torch.randn(1_000_000, generator=g, dtype=D)
    assert ness(torch.exp(lw)).ness == pytest.approx(math.exp(-s2), rel=0.01)


def test_e5_sequence_ness_from_iid_tokens():
    # T iid tokens each with per-token s^2: sequence ness -> exp(-T s^2) (within 5% for T s^2 <= 2)
    g = torch.Generator().manual_seed(5)
    T, s2, n = 20, 0.05, 400_000
    log_rho = -s2 / 2 + math.sqrt(s2) * torch.randn(n, T, generator=g, dtype=D)
    l_seq = sequence_log_weights(log_rho, torch.ones(n, T, dtype=D))
    assert kish_of(log_kish(l_seq)).ness == pytest.approx(math.exp(-T * s2), rel=0.05)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_e6_advantage_ess_binary_group(k):
    # G = 8, k correct: A = r - k/8 -> within-group ESS of |A| = 4 k (G - k) / G
    G = 8
    r = torch.tensor([1.0] * k + [0.0] * (G - k), dtype=D)
    adv = r - r.mean()
    assert ness(adv.abs()).ess == pytest.approx(4 * k * (G - k) / G, rel=1e-12)


def test_e6_degenerate_group_has_zero_weight_and_adv_token_form():
    adv = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=D)  # second group degenerate
    assert ness(adv.abs()).ness == pytest.approx(0.5)  # two equal weights of N = 4
    # token form: (sum T|A|)^2 / (sum T A^2) / sum T with lengths 2, 6, 3, 3 (|A| counted T times)
    t = torch.tensor([2.0, 6.0, 3.0, 3.0], dtype=D)
    r = kish_of(log_kish(weight_log(adv.abs()), counts=t))
    assert r.ness == pytest.approx((2 * 0.5 + 6 * 0.5) ** 2 / (8 * 0.25) / 14, rel=1e-12)


def test_group_ness_of_unequal_groups_is_each_group_s_own():
    # per_prompt allocation's groups of 2, 3 and 1: [1, 1] even (ness 1), [1, 0, 0] one weight (1/3), [5] (1)
    lw = torch.log(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 5.0], dtype=D))
    torch.testing.assert_close(group_ness(lw, [2, 3, 1]), torch.tensor([1.0, 1 / 3, 1.0], dtype=D))
    torch.testing.assert_close(group_ness(lw, [3, 3]), group_ness(lw, 3))  # equal sizes: the [groups, G] view


def test_group_ness_per_group():
    lw = torch.tensor([0.0, 0.0, 0.0, 0.0, 50.0, 0.0, 0.0, 0.0], dtype=D)  # group 2 dominated by one sequence
    torch.testing.assert_close(group_ness(lw, 4), torch.tensor([1.0, 0.25], dtype=D))


# ------------------------------------------------------------------------ log domain and bad inputs
@pytest.mark.parametrize("scale_exp", [-300, -170, -50, 0, 50, 170, 300])
def test_scaling_every_weight_changes_nothing(scale_exp):
    # Kish is scale invariant: weights x 1e-300 .. 1e+300 give the unscaled ESS to 1e-12. (Squaring raw
    # weights overflows above ~1e154 and underflows below ~1e-162; 1e-170 used to read as ESS 0.)
    w = torch.rand(64, generator=torch.Generator().manual_seed(6), dtype=D) + 0.05
    ref = ness(w)
    scaled = ness(w * 10.0**scale_exp)
    assert scaled.defined and scaled.ess == pytest.approx(ref.ess, rel=1e-12)
    # the same through log weights shifted by the log of the scale, and for the group and token forms
    lw = torch.log(w) + scale_exp * math.log(10)
    assert kish_of(log_kish(lw)).ess == pytest.approx(ref.ess, rel=1e-12)
    assert group_ness(lw, 8).tolist() == pytest.approx(group_ness(torch.log(w), 8).tolist(), rel=1e-12)
    counts = torch.arange(64, dtype=D) % 5 + 1
    assert kish_of(log_kish(lw, counts=counts)).ess == pytest.approx(
        kish_of(log_kish(torch.log(w), counts=counts)).ess, rel=1e-12
    )


@pytest.mark.parametrize("big", [400.0, 800.0, 1000.0, -1000.0])
def test_huge_log_ratios_give_the_exact_ess(big):
    # One token at log ratio +big among 9 at 0: for big >= 400 the others' weights are < e^-400 of it, so
    # ESS = (1 + 9e^-big)^2 / (1 + 9e^-2big) = 1 to double precision. At -big the tiny one drops out: ESS of
    # 9 equal weights and one ~0: (9 + e^-big)^2 / (9 + e^-2big) = 9. (Raw weights: OverflowError at 400,
    # NaN at 800.)
    lw = torch.zeros(10, dtype=D)
    lw[3] = big
    expect = 1.0 if big > 0 else 9.0
    r = kish_of(log_kish(lw))
    assert r.defined and r.ess == pytest.approx(expect, rel=1e-12)
    # split across two "ranks" with different shifts, combined as the probes combine them
    parts = kish_of(log_kish(lw[:5]) + log_kish(lw[5:]))
    assert parts.ess == pytest.approx(expect, rel=1e-12)
    seq = sequence_log_weights(lw.view(2, 5), torch.ones(2, 5))  # sequence sums +big and 0
    assert kish_of(log_kish(seq)).ess == pytest.approx(1.0, rel=1e-12)  # one sum is +-big


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_weight_gives_the_critical_reading_without_exception(bad):
    lw = torch.zeros(10, dtype=D)
    lw[2] = bad
    r = kish_of(log_kish(lw))
    assert (r.ess, r.ness, r.defined) == (0.0, 0.0, True)  # defined, critical (< 0.8), not NaN
    assert float(log_kish(lw).bad) == 1.0
    assert kish_of(log_kish(lw[3:]) + log_kish(lw[:3])).ness == 0.0  # stays critical when combined
    assert group_ness(lw, 5).tolist() == [0.0, 1.0]  # only the group holding it reads 0
    assert ness(torch.tensor([1.0, -1.0], dtype=D)).ness == 0.0  # a negative weight is invalid too
    # a NaN or inf at a pad position is ignored (masked by where, not multiplied by a 0 mask)
    mask = torch.ones(10)
    mask[2] = 0
    assert kish_of(log_kish(lw, mask)).ness == 1.0
    assert sequence_log_weights(lw.view(1, 10), mask.view(1, 10)).tolist() == [0.0]


def test_minus_inf_log_weight_is_a_zero_weight():
    lw = torch.tensor([0.0, 0.0, -math.inf, 0.0], dtype=D)  # a token the trainer gives probability 0
    r = kish_of(log_kish(lw))
    assert r.defined and r.ess == pytest.approx(3.0) and r.ness == pytest.approx(0.75)


def test_nan_quantile_is_torchs_without_its_size_limit():
    """Issue 29 N9: torch.nanquantile refuses more than 2^24 elements, which a long-context step's tokens pass;
    ess.nan_quantile gives its values (NaNs skipped, linear interpolation) at any size."""
    import math

    from rl_training.probes import probe
    from rl_training.probes.ess import nan_quantile

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        x = torch.randn(n, generator=g, dtype=torch.float64).exp()
        x[torch.rand(n, generator=g) < 0.3] = math.nan
        for q in (0.0, 0.5, 0.999, 1.0):
            want = torch.nanquantile(x, q)
            assert torch.equal(nan_quantile(x, q).isnan(), want.isnan())
            if not want.isnan():
                assert nan_quantile(x, q).item() == pytest.approx(want.item(), rel=1e-12)
    assert nan_quantile(torch.full((3,), math.nan), 0.5).isnan()
    assert nan_quantile(torch.tensor([1.0, math.inf]), 0.999).item() == math.inf
    big = torch.arange(2**24 + 2, dtype=torch.float32)  # 0 .. 2^24 + 1
    with pytest.raises(RuntimeError, match="too large"):
        torch.nanquantile(big, 0.5)
    # q (n - 1) = 0.5 (2^24 + 1): halfway between 2^23 and 2^23 + 1
    assert nan_quantile(big, 0.5).item() == pytest.approx(2**23 + 0.5)
    assert "torch.nanquantile" not in inspect.getsource(probe)  # the probe uses the unlimited one
