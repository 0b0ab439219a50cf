"""Off-policy corrections (rl_training/algs/corrections.py) against closed-form values: weights, counts, and
TIS bit-identical to the formula the trainer used before corrections had their own slot."""

from __future__ import annotations

import math

import pytest
import torch

from rl_training.algs.corrections import CORRECTIONS, SequenceGeoMask, TokenMask, TruncatedIS

D = torch.float64


def case(log_rho: list[list[float]], mask: list[list[float]]):
    """logp = -1 everywhere, the sampler's log-probs logp - log_rho on the mask (0 off it): rho_t = exp(log_rho_t)."""
    lr = torch.tensor(log_rho, dtype=D)
    m = torch.tensor(mask, dtype=D)
    logp = torch.full_like(lr, -1.0)
    return logp, (logp - lr) * m, m


def test_tis_weights_are_min_rho_cap_and_count_the_truncated():
    # rho = 2, 0.5, 1, (masked: 9) and 3, 1.5 | cap 1.5 -> w = 1.5, 0.5, 1, 0 and 1.5, 1.5; truncated: 2 and 3 -> 2
    logp, rlogp, m = case([[math.log(2), math.log(0.5), 0.0, math.log(9)], [math.log(3), math.log(1.5), 0, 0]],
                          [[1, 1, 1, 0], [1, 1, 0, 0]])  # fmt: skip
    out = TruncatedIS(cap=1.5)(logp, rlogp, m)
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 0.5, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0]], dtype=D))
    assert out.counts["is/trunc_frac"].item() == 2  # 1.5 itself is not above the cap


def test_tis_is_bit_identical_to_the_formula_it_replaced():
    # Before the correction slot: w = clamp(exp(logp - rollout_logp), max=cap) * mask, counted (rho > cap) with
    # rho = where(mask, exp(logp - rollout_logp), 0). Random float32 values with off-mask garbage.
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 40, generator=g) * 5
    rollout = logp + torch.randn(6, 40, generator=g) * 0.7
    mask = (torch.rand(6, 40, generator=g) > 0.3).float()
    rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, 50.0))
    for cap in (0.5, 1.0, 2.0, 10.0):
        out = TruncatedIS(cap)(logp, rollout, mask)
        old = torch.clamp(torch.exp(logp - rollout), max=cap) * mask
        rho = torch.where(mask.bool(), (logp - rollout).exp(), 0.0)
        assert torch.equal(out.weights, old)
        assert out.counts["is/trunc_frac"].item() == (rho > cap).sum().item()


def test_token_mask_zeroes_tokens_outside_the_band():
    # band [0.5, 2]: rho = 0.25 (low), 0.5 (kept: the bound is inside), 2.0 (kept), 4 (high), 1 | masked 100
    logp, rlogp, m = case([[math.log(0.25), math.log(0.5), math.log(2.0), math.log(4.0), 0.0, math.log(100)]],
                          [[1, 1, 1, 1, 1, 0]])  # fmt: skip
    out = TokenMask(low=0.5, high=2.0)(logp, rlogp, m)
    assert out.weights.tolist() == [[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]]
    assert out.counts["is/masked_low_frac"].item() == 1 and out.counts["is/masked_high_frac"].item() == 1


def test_sequence_geo_mask_uses_the_geometric_mean_of_each_sequence():
    # seq 0: log rho = (0.03, -0.01) -> mean 0.01 -> geo e^0.01 = 1.01005 > 1.01: masked, both tokens
    # seq 1: log rho = (0.5, -0.5, 0)  -> mean 0 -> geo 1: kept (one token's rho is e^0.5 = 1.65: a token
    #        mask would drop it, the geometric mean does not)
    # seq 2: log rho = (-0.02,) -> geo 0.980 < 0.99: masked; seq 3: no completion tokens -> never counted
    logp, rlogp, m = case(
        [[0.03, -0.01, 0.0], [0.5, -0.5, 0.0], [-0.02, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]],
    )
    out = SequenceGeoMask(low=0.99, high=1.01)(logp, rlogp, m)
    assert out.weights.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert out.counts["is/masked_seqs_frac"].item() == 2 and out.counts["is/masked_frac"].item() == 3


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_weights_vanish_off_the_mask_carry_no_gradient_and_declare_their_counts(name):
    logp = torch.randn(3, 5, dtype=D, requires_grad=True)
    rollout = logp.detach() + 0.3 * torch.randn(3, 5, dtype=D)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=D)
    corr = CORRECTIONS[name]()
    out = corr(logp.detach(), rollout * mask, mask)
    assert not out.weights.requires_grad and (out.weights[mask == 0] == 0).all() and (out.weights >= 0).all()
    assert set(out.counts) == set(corr.counts) and set(corr.counts.values()) <= {"tokens", "sequences"}


def test_on_policy_every_correction_is_the_identity():
    # rho = 1 on every token: TIS with cap >= 1 and both masks keep every weight at 1 and count nothing
    logp = -torch.rand(4, 7, dtype=D)
    mask = torch.ones(4, 7, dtype=D)
    for corr in (TruncatedIS(1.0), TokenMask(), SequenceGeoMask()):
        out = corr(logp, logp.clone(), mask)
        assert torch.equal(out.weights, mask) and all(v.item() == 0 for v in out.counts.values())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TruncatedIS(0.0), "tis needs a cap > 0"),
        (lambda: TruncatedIS(math.inf), "tis needs a cap > 0"),
        (lambda: TokenMask(low=1.5), "token_mask needs 0 <= low <= 1 <= high"),
        (lambda: SequenceGeoMask(high=0.9), "seq_geo_mask needs 0 <= low <= 1 <= high"),
    ],
)
def test_bands_and_caps_that_would_drop_on_policy_tokens_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
