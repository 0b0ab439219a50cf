"""ESS oracles E1-E6 from ../shared/docs/GNS_ESS.md section 3."""

from __future__ import annotations

import math

import pytest
import torch

from rl_training.probes.ess import (
    KishSums,
    adv_token_ness,
    advantage_token_sums,
    group_ness,
    kish,
    kish_sums,
    log_domain_sums,
    sequence_log_weights,
)

D = torch.float64


def ness(w, mask=None):
    return kish(kish_sums(torch.as_tensor(w, dtype=D), None if mask is None else torch.as_tensor(mask)))


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
    whole = kish(kish_sums(torch.cat([a, b])))
    summed = kish(kish_sums(a) + kish_sums(b))  # what the all-reduce of (sum w, sum w^2, N) gives
    assert summed.ess == pytest.approx(whole.ess, rel=1e-12)
    mean_of_shards = (kish(kish_sums(a)).ness + kish(kish_sums(b)).ness) / 2
    assert abs(mean_of_shards - whole.ness) > 0.01


def test_e3_masking_padding_and_all_zero():
    w = torch.ones(100, dtype=D)
    w[:25] = 0.0  # mask f = 0.25 of uniform weights to 0, N fixed -> ness = 0.75
    assert ness(w).ness == pytest.approx(0.75)
    # Pad tokens (mask 0) are excluded from N.
    assert ness([1.0, 1.0, 9.0, 9.0], mask=[1, 1, 0, 0]).ness == pytest.approx(1.0)
    z = kish(KishSums(0.0, 0.0, 10.0))
    assert (z.ess, z.ness, z.defined) == (0.0, 0.0, False)


def test_e4_log_domain_sequence_weights():
    # sum_t log rho = +-1000: finite, and one dominant weight gives ESS -> 1
    lw = torch.tensor([1000.0, -1000.0, 0.0], dtype=D)
    r = kish(log_domain_sums(lw, lw.max().item()))
    assert math.isfinite(r.ess) and r.ess == pytest.approx(1.0)
    # moderate values match the naive computation
    log_rho = 0.1 * torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=D)
    mask = torch.ones(6, 5, dtype=D)
    mask[2, 3:] = 0
    l_seq = sequence_log_weights(log_rho, mask)
    naive = kish(kish_sums(torch.exp((log_rho * mask).sum(1))))
    assert kish(log_domain_sums(l_seq, l_seq.max().item())).ess == pytest.approx(naive.ess, rel=1e-12)


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
    assert kish(log_domain_sums(l_seq, l_seq.max().item())).ness == pytest.approx(math.exp(-T * s2), rel=0.05)


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
    # token form: (sum T|A|)^2 / (sum T A^2) / sum T with lengths 2, 6, 3, 3
    s1, s2, t = advantage_token_sums(adv, torch.tensor([2.0, 6.0, 3.0, 3.0], dtype=D))
    assert adv_token_ness(s1, s2, t) == pytest.approx((2 * 0.5 + 6 * 0.5) ** 2 / (8 * 0.25) / 14, rel=1e-12)


def test_group_ness_per_group():
    lw = torch.tensor([0.0, 0.0, 0.0, 0.0, 50.0, 0.0, 0.0, 0.0], dtype=D)  # group 2 dominated by one sequence
    torch.testing.assert_close(group_ness(lw, 4), torch.tensor([1.0, 0.25], dtype=D))
