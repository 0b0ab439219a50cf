"""The nested ANOVA's inputs are capturable with the existing hooks (docs/probes.md 9.4): LoraUnitCapture armed
with one unit per sequence gives sum_ij |h_ij|^2, armed with one unit per group sum_i |h_i|^2; through
group_sums_from_contributions, nested_anova equals a direct ANOVA of brute-force per-completion gradients of the
tiny LoRA model (float64)."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.objectives import StepNorm
from rl_training.policy.models import trainable_parameters
from rl_training.probes.anova import group_sums_from_contributions, nested_anova
from rl_training.probes.capture import LoraUnitCapture
from tests.helpers import G, backward, fake_rollouts, flat_grad, lora_policy, one_micro_batch

N_GROUPS = 4


def test_captured_sums_give_the_direct_anova(tiny_model):
    model = lora_policy(tiny_model, seed=2)
    params = trainable_parameters(model)
    ro = fake_rollouts(N_GROUPS, seed=8)
    adv = torch.tensor([0.7, -0.7, 0.2, -0.2, 1.0, -1.0, -0.4, 0.4], dtype=torch.float64)
    norm = StepNorm(seqs=N_GROUPS * G, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    groups = list(range(N_GROUPS))
    # Brute force: completion (i, j)'s contribution h_ij is the step's gradient with every other advantage set
    # to 0 (Dr-GRPO without KL: a zero-advantage sequence adds nothing). One rank, U = 4 groups: gbar_i =
    # U h_i and g_ij = K U h_ij (K = G = 2), so the step gradient sum_ij h_ij is the mean of the g_ij.
    h = torch.zeros(N_GROUPS, G, sum(p.numel() for p in params), dtype=torch.float64)
    for s in range(N_GROUPS * G):
        model.zero_grad(set_to_none=True)
        only = torch.zeros_like(adv)
        only[s] = adv[s]
        backward(model, one_micro_batch(ro, only, groups), norm)
        h[s // G, s % G] = flat_grad(params)
    g = (G * N_GROUPS * h).numpy()
    gbar_i, gbar = g.mean(1), g.mean((0, 1))
    ms_w = ((g - gbar_i[:, None]) ** 2).sum() / (N_GROUPS * (G - 1))
    ms_b = G * ((gbar_i - gbar) ** 2).sum() / (N_GROUPS - 1)
    # The hooks: one backward of the whole micro-batch per arming (per sequence, then per group); Q from .grad.
    cap = LoraUnitCapture(model)
    try:
        got = []
        for units in (N_GROUPS * G, N_GROUPS):
            model.zero_grad(set_to_none=True)
            with cap.capture(units):
                backward(model, one_micro_batch(ro, adv, groups), norm)
            assert cap.hooks_ok
            got.append(cap.unit_sq_norms.sum().item())
        q = flat_grad(params).pow(2).sum().item()
    finally:
        cap.remove()
    assert q == pytest.approx(float((gbar**2).sum()), rel=1e-9)
    # N = 8 completions on one rank: g_ij = (N / W) h_ij; the group sum is read as sum_i |h_i|^2 / k_i
    n = N_GROUPS * G
    est = nested_anova(group_sums_from_contributions(got[0], got[1] / G, N_GROUPS, n, N_GROUPS * G * G, float(n)), q)
    assert est.trace_within == pytest.approx(ms_w, rel=1e-9)
    assert est.trace_between == pytest.approx((ms_b - ms_w) / G, rel=1e-9)
    assert est.trace_group == pytest.approx(ms_b / G, rel=1e-9)
    assert ms_w > 0 and ms_b > 0  # a non-degenerate case
