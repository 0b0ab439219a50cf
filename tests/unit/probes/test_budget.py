"""The rollout-budget probe in the step (docs/probes.md 9.4, 10.2): the unit capture's one flush gives each
sequence's and each group's squared norm, padded or packed; StepProbes feeds the nested ANOVA exactly the direct
ANOVA of brute-force per-completion gradients of the tiny LoRA model (float64), with zero-advantage groups left
out whether their forward is skipped or not; the waste curve, the costs and the resume state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_training.algs.objectives import StepNorm
from rl_training.base.groups import Groups
from rl_training.policy.models import trainable_parameters
from rl_training.probes.advisor import SplitCosts, best_k, group_waste, waste_fraction
from rl_training.probes.budget import K_MAX, RolloutBudget, StepWork, split_seconds
from rl_training.probes.capture import LoraUnitCapture
from rl_training.probes.probe import StepProbes
from rl_training.train.batches import make_micro_batches
from rl_training.train.learner import UpdateHParams, train_on_rollouts
from tests.helpers import G, backward, fake_rollouts, flat_grad, lora_policy, one_micro_batch

N_GROUPS = 4
ADV = torch.tensor([0.7, -0.7, 0.2, -0.2, 1.0, -1.0, -0.4, 0.4], dtype=torch.float64)


@pytest.fixture(scope="module")
def setup(tiny_model):
    model = lora_policy(tiny_model, seed=3)
    ro = fake_rollouts(N_GROUPS, seed=9)
    norm = StepNorm(seqs=N_GROUPS * G, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    return model, ro, norm


def per_sequence_gradients(model, ro, adv, norm) -> torch.Tensor:
    """[N_GROUPS, G, d] brute force: sequence s's contribution h_s to the step gradient is the gradient with
    every other advantage set to 0 (Dr-GRPO without KL: a zero-advantage sequence adds nothing)."""
    params = trainable_parameters(model)
    h = torch.zeros(N_GROUPS, G, sum(p.numel() for p in params), dtype=torch.float64)
    for s in range(N_GROUPS * G):
        model.zero_grad(set_to_none=True)
        only = torch.zeros_like(adv)
        only[s] = adv[s]
        backward(model, one_micro_batch(ro, only, list(range(N_GROUPS))), norm)
        h[s // G, s % G] = flat_grad(params)
    return h


def direct_anova(g: np.ndarray) -> dict[str, float]:
    """Classical nested ANOVA of completion gradients g [B, K, d] (docs/probes.md 9.2): MS_w, (MS_b - MS_w)/K,
    and |G|^2 = Q - MS_b/(K B)."""
    b, k = g.shape[:2]
    gbar_i, gbar = g.mean(1), g.mean((0, 1))
    ms_w = ((g - gbar_i[:, None]) ** 2).sum() / (b * (k - 1))
    ms_b = k * ((gbar_i - gbar) ** 2).sum() / (b - 1)
    return {
        "trace_within": ms_w,
        "trace_between": (ms_b - ms_w) / k,
        "grad_sq_norm": float((gbar**2).sum()) - ms_b / (k * b),
    }


UNEQUAL = (1, 3, 2, 2)  # the same 8 rows as groups of unequal sizes (rollout.allocation: per_prompt)


@pytest.mark.parametrize("sizes", [(G,) * N_GROUPS, UNEQUAL])
@pytest.mark.parametrize("per_seq", [True, False])
@pytest.mark.parametrize("packed,chunked", [(False, False), (True, False), (False, True)])
def test_one_flush_gives_each_sequence_and_each_group_norm(setup, packed, chunked, per_seq, sizes, monkeypatch):
    # Unequal groups, padded, are gathered group by group. Splitting the 8 rows evenly, as the capture did before it
    # read the sizes, gave group 0 of UNEQUAL (one row) the norm of rows 0-1: 0.0528 against its 0.0082.
    model, ro, norm = setup
    if chunked:  # one layer's products at a time (a flush's memory bound): the same norms
        monkeypatch.setattr(LoraUnitCapture, "PRODUCT_BYTES", 1)
    h = per_sequence_gradients(model, ro, ADV, norm).flatten(0, 1)  # [rows, d]
    groups = Groups(sizes)
    mb = make_micro_batches(ro, ADV, groups, N_GROUPS, 0, torch.device("cpu"), pack_row_tokens=0 if packed else None)
    mb = mb[0]
    assert (mb.packed is not None) == packed
    p = mb.packed
    cap = LoraUnitCapture(model)
    try:
        tokens = {"per_sequence": True, "seq_tokens": p.seq_tokens if packed else None} if per_seq else {}
        with cap.capture(N_GROUPS, p.group_tokens if packed else None, group_sizes=sizes, **tokens):
            update(model, [mb], norm)
        assert cap.hooks_ok
    finally:
        cap.remove()
    if per_seq:
        assert cap.seq_sq_norms.shape == (len(h),)
        for r in range(len(h)):
            assert cap.seq_sq_norms[r].item() == pytest.approx(h[r].pow(2).sum().item(), rel=1e-8)
    for i in range(N_GROUPS):
        h_i = h[list(groups.rows_of([i]))].sum(0)
        assert cap.unit_sq_norms[i].item() == pytest.approx(h_i.pow(2).sum().item(), rel=1e-8)


def update(model, mbs, norm, probes=None, kl_coef=0.0) -> None:
    """One step of the real update at learning rate 0 (the adapter is unchanged for the next test)."""
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    hp = UpdateHParams(max_grad_norm=1e-6, kl_coef=kl_coef)  # clipping must not change Q (measured before it)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    train_on_rollouts(model, opt, sched, params, mbs, hp, norm, *([probes] if probes else []))


def budget_probes(model, params, *, exact_zero=True, units=N_GROUPS, groups_per_micro=2) -> StepProbes:
    budget = RolloutBudget(
        group_size=G,
        units_per_step=units,
        world_size=1,
        ema_beta=0.9,
        exact_zero=exact_zero,
        b_multiple=groups_per_micro,
        device=torch.device("cpu"),
    )
    return StepProbes(
        model,
        params,
        levels=["unit", "micro"],
        ema_beta=0.9,
        units_per_step=units,
        world_size=1,
        micro_batch_groups=groups_per_micro,
        device=torch.device("cpu"),
        budget=budget,
    )


def probed_step(model, ro, adv, norm, *, drop=False, kl_coef=0.0, packed=False, exact_zero=True, work=None, groups=G):
    params = trainable_parameters(model)
    probes = budget_probes(model, params, exact_zero=exact_zero)
    rewards = [float(a) for a in adv]  # the waste curve reads them; any values will do here
    try:
        mbs = make_micro_batches(
            ro, adv, groups, 2, 0, torch.device("cpu"), drop_zero_adv_groups=drop, pack_row_tokens=0 if packed else None
        )
        probes.begin_step(groups, adv, [len(c) for c in ro.completion_ids], 0, rewards)
        update(model, mbs, norm, probes, kl_coef)
        out = probes.metrics(work)
    finally:
        probes.remove_hooks()
    return probes.budget, out


@pytest.mark.parametrize("packed", [False, True])
def test_the_steps_anova_equals_a_direct_anova_of_brute_force_gradients(setup, packed):
    model, ro, norm = setup
    # One rank, U = 4 groups: gbar_i = U h_i, g_ij = K U h_ij (docs/probes.md 2, 9.4)
    g = (G * N_GROUPS * per_sequence_gradients(model, ro, ADV, norm)).numpy()
    expect = direct_anova(g)
    budget, out = probed_step(model, ro, ADV, norm, packed=packed)
    got = budget.last
    assert got is not None and got.groups == N_GROUPS and got.k == G
    for q, v in expect.items():
        assert getattr(got, q) == pytest.approx(v, rel=1e-7), q
        assert out[f"probe/anova/{q}_raw"] == getattr(got, q)
    assert expect["trace_within"] > 0 and expect["trace_between"] != 0  # a non-degenerate case
    assert out["probe/anova/groups"] == N_GROUPS and out["probe/advisor/k_current"] == G


def unequal_anova(h: torch.Tensor, sizes) -> dict[str, float]:
    """The textbook unbalanced one-way ANOVA (Searle) of completion gradients g = N h (one rank: g_ij = (N/W) h_ij,
    the step gradient their mean): MS_w pooled within groups, MS_b = sum_i k_i |gbar_i - gbar|^2 / (B - 1) with
    E MS_b = tr S_w + n0 tr S_b, n0 = (N - sum k_i^2 / N)/(B - 1); |G|^2 = Q - c tr S_b - tr S_w / N (E Q, c =
    sum k_i^2 / N^2)."""
    n, b = len(h), len(sizes)
    g = (n * h).numpy()
    parts = np.split(g, np.cumsum(sizes)[:-1])
    means = np.stack([x.mean(0) for x in parts])
    gbar = g.mean(0)
    ms_w = sum(((x - m) ** 2).sum() for x, m in zip(parts, means, strict=True)) / (n - b)
    ms_b = sum(k * ((m - gbar) ** 2).sum() for k, m in zip(sizes, means, strict=True)) / (b - 1)
    k2 = sum(k * k for k in sizes)
    tr_b = (ms_b - ms_w) / ((n - k2 / n) / (b - 1))
    return {
        "trace_within": ms_w,
        "trace_between": tr_b,
        "grad_sq_norm": float((gbar**2).sum()) - k2 / n**2 * tr_b - ms_w / n,
    }


@pytest.mark.parametrize("packed", [False, True])
def test_unequal_groups_anova_equals_the_textbook_unbalanced_one(setup, packed):
    # rollout.allocation: per_prompt's groups: the same 8 rows as groups of 1, 3, 2 and 2 (mean K = 2 = G, the
    # budget's), fed through the capture, StepProbes and the all-reduce sums; the estimates are the textbook ones.
    model, ro, norm = setup
    h = per_sequence_gradients(model, ro, ADV, norm).flatten(0, 1)
    expect = unequal_anova(h, UNEQUAL)
    budget, out = probed_step(model, ro, ADV, norm, packed=packed, groups=Groups(UNEQUAL))
    got = budget.last
    assert got is not None and got.groups == N_GROUPS and got.k == 2.0 and out["probe/anova/groups"] == N_GROUPS
    for q, v in expect.items():
        assert getattr(got, q) == pytest.approx(v, rel=1e-7), q
    # the balanced formulas read with the mean size (K = 2) are not these: the test tells the two apart
    balanced = direct_anova((len(h) * h).numpy().reshape(N_GROUPS, G, -1))
    assert abs(balanced["trace_between"] - expect["trace_between"]) > 1e-3 * abs(expect["trace_between"])


def test_unequal_groups_leave_zero_advantage_groups_out(setup):
    # Group 1 of UNEQUAL (rows 1-3) has zero advantages: B = 3 groups of 1, 2 and 2 (N_fed = 5), and Q of their
    # mean is |G_B|^2 (N / N_fed)^2 with N = 8 (budget.py update). A group of the mean size left out could not
    # tell that from the fixed split's (U / B)^2: here 64/25 against 16/9.
    model, ro, norm = setup
    adv = ADV.clone()
    adv[1:4] = 0.0
    h = per_sequence_gradients(model, ro, adv, norm).flatten(0, 1)
    keep = [0, 4, 5, 6, 7]
    expect = unequal_anova(h[keep] * 8 / 5, (1, 2, 2))  # unequal_anova scales by its own N (5): g = 8 h
    got = probed_step(model, ro, adv, norm, groups=Groups(UNEQUAL))[0].last
    assert got.groups == 3 and got.k == 5 / 3
    for q, v in expect.items():
        assert getattr(got, q) == pytest.approx(v, rel=1e-7), q


@pytest.mark.parametrize("drop", [False, True])
def test_zero_advantage_groups_are_left_out_whether_skipped_or_trained_on(setup, drop):
    # exact_zero (no KL): group 1 has zero advantages, so a zero gradient. The ANOVA reads the three informative
    # groups: B = 3, and Q is the squared norm of their mean, |G_B|^2 (U/B)^2 with U = 4 (docs/probes.md 9.4).
    model, ro, norm = setup
    adv = ADV.clone()
    adv[G : 2 * G] = 0.0
    keep = [0, 2, 3]
    g = (G * N_GROUPS * per_sequence_gradients(model, ro, adv, norm)).numpy()[keep]
    expect = direct_anova(g)
    got = probed_step(model, ro, adv, norm, drop=drop)[0].last
    assert got.groups == 3
    for q, v in expect.items():
        assert getattr(got, q) == pytest.approx(v, rel=1e-7), q


def test_with_a_kl_term_every_group_is_fed_in(setup):
    # A KL term gives a zero-advantage group a gradient: it is not wasted, and the ANOVA reads all U groups.
    model, ro, norm = setup
    adv = ADV.clone()
    adv[G : 2 * G] = 0.0
    budget, out = probed_step(model, ro, adv, norm, kl_coef=0.1, exact_zero=False)
    assert budget.last.groups == N_GROUPS
    assert out["probe/advisor/waste_at_k"] == 0.0  # waste ignored


def test_group_waste_is_laplaces_rule_for_binary_rewards():
    # s successes of K = 8: p = (s + 1)/(K + 2), w(k) = p^k + (1 - p)^k
    for s in range(9):
        rewards = [1.0] * s + [0.0] * (8 - s)
        p = (s + 1) / 10
        got = group_waste(rewards, 12)
        assert got == pytest.approx([waste_fraction([p], k) for k in range(1, 13)], rel=1e-12)
    # three distinct values of K = 4 (counts 2, 1, 1): q = (3, 2, 2)/7, w(k) = sum q^k; w(1) = 1
    assert group_waste([0.5, 0.5, 0.2, 1.0], 3) == pytest.approx([1.0, 17 / 49, 43 / 343])
    assert group_waste([], 3) == [0.0, 0.0, 0.0]


def test_waste_pushes_k_up_through_the_curve():
    # Every prompt at p = 0.9 (the worked case of test_advisor): the curve form gives the same K* as pass rates.
    curve = tuple(waste_fraction([0.9], k) for k in range(1, K_MAX + 1))
    assert best_k(1.0, 4.0, SplitCosts(1.0, 1.0, waste_by_k=curve)) == best_k(1.0, 4.0, SplitCosts(1.0, 1.0, (0.9,)))
    assert best_k(1.0, 4.0, SplitCosts(1.0, 1.0, waste_by_k=curve)) == 9


def test_costs_split_generation_by_tokens_when_the_prompt_is_prefilled_once():
    # 2 prompts of 30 tokens (60 once) and 8 completions of 15 (120): a third of generation is the prompts'.
    work = StepWork({"generate": 3.0, "score": 0.5, "train": 2.5, "sync": 9.0}, 2, 8, 60, 120, prompt_once=True)
    assert split_seconds(work) == pytest.approx((1.0, 2.0 + 0.5 + 2.5))  # sync is per step: in neither
    hf = StepWork(work.seconds, 2, 8, 60, 120, prompt_once=False)  # HF repeats the prompt per completion
    assert split_seconds(hf) == pytest.approx((0.0, 6.0))


def test_advice_is_logged_and_resumes_exactly(setup):
    model, ro, norm = setup
    work = StepWork({"generate": 3.0, "score": 0.5, "train": 2.5}, N_GROUPS, N_GROUPS * G, 60, 120, True)
    budget, out = probed_step(model, ro, ADV, norm, work=work)
    assert out["probe/advisor/cost_prompt_s"] == pytest.approx(1.0 / N_GROUPS)
    assert out["probe/advisor/cost_rollout_s"] == pytest.approx(5.0 / (N_GROUPS * G))
    assert out["probe/anova/trusted"] == 0.0 and out["probe/alert/rollout_split"] == 0.0  # one step: warm-up
    fresh = RolloutBudget(
        group_size=G, units_per_step=N_GROUPS, world_size=1, ema_beta=0.9, exact_zero=True, b_multiple=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    fresh.load_state_dict(budget.state_dict())
    assert fresh.state_dict() == budget.state_dict()
    assert fresh._advice_metrics() == pytest.approx(budget._advice_metrics(), nan_ok=True)
    other_beta = RolloutBudget(
        group_size=G, units_per_step=N_GROUPS, world_size=1, ema_beta=0.5, exact_zero=True, b_multiple=2,
        device=torch.device("cpu"),
    )  # fmt: skip
    other_beta.load_state_dict(budget.state_dict())  # another beta restarts every EMA
    assert other_beta.state.t == 0 and other_beta.waste.t == 0 and other_beta.costs.t == 0
    assert math.isnan(other_beta.costs.value[0])


def test_the_anova_smooths_over_steps_not_over_its_updates():
    """The ANOVA updates every probe.unit_every-th step only; its EMA factor is beta^unit_every, so its warm-up and
    trust lag span the steps a per-step EMA's do. beta 0.95: warm-up 3/(1 - beta) = 60 steps and lag
    (1 + beta)/(1 - beta) = 39 steps; at unit_every 4 the factor 0.95^4 = 0.8145 gives ceil(3/0.1855) = 17 updates
    (68 steps) and ceil(1.8145/0.1855) = 10 updates (40 steps). With beta itself they were 60 and 39 updates: 240
    and 156 steps, so a 100-step run could never trust the advice (issue 52, item 3)."""
    from rl_training.probes.anova import AnovaEstimate, AnovaState

    def anova(every: int) -> AnovaState:
        return RolloutBudget(
            group_size=G, units_per_step=N_GROUPS, world_size=1, ema_beta=0.95, exact_zero=True, b_multiple=2,
            device=torch.device("cpu"), measured_every=every,
        ).state  # fmt: skip

    assert anova(1).beta == 0.95 and (anova(1).warmup, anova(1).lag) == (60, 39)
    assert anova(4).beta == pytest.approx(0.95**4) and (anova(4).warmup, anova(4).lag) == (17, 10)
    # a stationary, well-measured triple: trusted after warm-up + lag updates whatever the cadence, in steps
    for every in (1, 4):
        state, steps = anova(every), 0
        while not state.trusted:
            steps += every
            between = 1.0 + 0.01 * (steps % 3)  # a little spread: the band needs a non-zero variance
            state.update(AnovaEstimate(between, 4.0, 1.0, between + 4.0 / G, groups=N_GROUPS, k=G))
        assert 60 <= steps <= 80, (every, steps)
