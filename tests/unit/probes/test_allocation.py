"""Completions per prompt (probes/allocation.py, issue 52 item 2): the dynamic programme against brute force on
simulated pass rates, its agreement with the advisor's K* for identical prompts, and where it spends."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_training.probes.advisor import SplitCosts, best_k, group_waste, waste_fraction
from rl_training.probes.allocation import allocate, allocation_value, group_value, reward_variance


def binary_curve(p: float, k_max: int) -> list[float]:
    return [waste_fraction([p], k) for k in range(1, k_max + 1)]


def brute_force(wastes, budget: int, ratio: float, k_min: int, k_max: int, signals, given=None) -> float:
    given = given or [0] * len(wastes)
    choices = [[g, *range(max(k_min, g), k_max + 1)] if g else [0, *range(k_min, k_max + 1)] for g in given]
    allocations = (ks for ks in itertools.product(*choices) if sum(ks) <= budget)
    return max(allocation_value(ks, wastes, ratio, signals) for ks in allocations)


@given(
    st.lists(st.floats(0, 1), min_size=1, max_size=4),
    st.integers(0, 16),
    st.floats(0, 20),
    st.integers(1, 3),
    st.integers(0, 4),
)
def test_the_allocation_is_the_brute_force_optimum(pass_rates, budget, ratio, k_min, extra):
    # simulated pass rates p: waste p^k + (1 - p)^k, signal p (1 - p)
    k_max = k_min + extra
    wastes = [binary_curve(p, k_max) for p in pass_rates]
    signals = [p * (1 - p) for p in pass_rates]
    ks = allocate(wastes, budget, ratio, k_min, k_max, signals)
    assert sum(ks) <= budget and all(k == 0 or k_min <= k <= k_max for k in ks)
    best = brute_force(wastes, budget, ratio, k_min, k_max, signals)
    assert allocation_value(ks, wastes, ratio, signals) == pytest.approx(best, abs=1e-12)


@given(
    st.lists(st.tuples(st.floats(0, 1), st.integers(0, 3)), min_size=1, max_size=4),
    st.integers(0, 16),
    st.floats(0, 20),
    st.integers(0, 3),
)
def test_a_first_round_is_kept_and_the_rest_is_the_brute_force_optimum(prompts, budget, ratio, extra):
    # rollout.allocation: per_prompt's first round: prompt i already has given[i] completions (counted in the
    # budget); it keeps them and may get more, never fewer. k_max covers every first round.
    k_min, k_max = 2, 3 + extra
    pass_rates, given = [p for p, _ in prompts], [g for _, g in prompts]
    budget += sum(given)
    wastes = [binary_curve(p, k_max) for p in pass_rates]
    signals = [p * (1 - p) for p in pass_rates]
    ks = allocate(wastes, budget, ratio, k_min, k_max, signals, given=given)
    assert sum(ks) <= budget and all(k == g or max(k_min, g) <= k <= k_max for k, g in zip(ks, given, strict=True))
    best = brute_force(wastes, budget, ratio, k_min, k_max, signals, given)
    assert allocation_value(ks, wastes, ratio, signals) == pytest.approx(best, abs=1e-12)


def test_a_first_round_over_the_budget_is_refused():
    with pytest.raises(ValueError, match="given"):
        allocate([binary_curve(0.5, 4)] * 2, 5, 1.0, 2, 4, given=[3, 3])


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
@pytest.mark.parametrize("ratio", [0.5, 4.0, 20.0])
def test_identical_prompts_get_the_advisor_k_star(p, ratio):
    # n v(k) = N v(k)/k and v(k)/k = (1 - w(k)) / (k + r) = 1 / f(k) with tr S_b = 1, tr S_w = r, c_p = 0, c_r = 1
    # (advisor.variance_cost): with prompts to spare, three prompts of the advisor's K* spend a budget of 3 K*.
    k_max = 32
    k_star = best_k(1.0, ratio, SplitCosts(0.0, 1.0, (p,), k_min=2, k_max=k_max))
    per_completion = [group_value(k, waste_fraction([p], k), ratio) / k for k in range(2, k_max + 1)]
    assert max(per_completion) == per_completion[k_star - 2]  # the same optimum, found independently
    wastes = [binary_curve(p, k_max)] * (3 * k_star // 2 + 1)  # more prompts than the budget can give k_min each
    ks = allocate(wastes, 3 * k_star, ratio, 2, k_max)
    if per_completion.count(max(per_completion)) == 1:
        assert sorted(k for k in ks if k) == [k_star] * 3
    assert allocation_value(ks, wastes, ratio) == pytest.approx(
        3 * group_value(k_star, waste_fraction([p], k_star), ratio)
    )


def test_completions_go_where_the_rewards_differ():
    # Seen before: prompt 0 always solved (8 of 8), prompt 1 half (4 of 8), prompt 2 never (0 of 8). Laplace's rule
    # gives p = 9/10, 1/2, 1/10 (group_waste's curves, reward_variance's 0.09, 0.25, 0.09): the half-solved prompt
    # has the most signal and the least waste, and gets the most; p and 1 - p get the same.
    seen = ([1.0] * 8, [0.0, 1.0] * 4, [0.0] * 8)
    wastes, signals = [group_waste(r, 16) for r in seen], [reward_variance(r) for r in seen]
    assert wastes[0][3] == pytest.approx(0.9**4 + 0.1**4) and wastes[1][3] == pytest.approx(2 * 0.5**4)
    assert signals == pytest.approx([0.09, 0.25, 0.09]) and reward_variance([]) == 0.25
    ks = allocate(wastes, 24, 4.0, 2, 16, signals)
    assert sum(ks) == 24 and ks[1] > max(ks[0], ks[2]) and abs(ks[0] - ks[2]) <= 1  # 13 left: 7 + 6
    # the waste term alone (all signals 1) would spend more on the skewed prompts: their waste falls slowest in k
    ks = allocate(wastes, 24, 4.0, 2, 16)
    assert ks[1] < ks[0]
    # a prompt that can only waste (its curve all 1) gets nothing; the others take its share
    ks = allocate([[1.0] * 16, *wastes[1:]], 24, 4.0, 2, 16, signals)
    assert ks[0] == 0 and sum(ks) == 24


def test_without_waste_more_within_prompt_noise_means_more_completions_per_prompt():
    # v(k)/k = 1/(k + r) falls with k: with prompts to spare every prompt gets k_min; with 2 prompts and 32
    # completions, the split is even (v concave without waste: 16 + 16).
    flat = [[0.0] * 32] * 16
    assert allocate(flat, 32, ratio=4.0, k_min=2, k_max=32) == [2] * 16
    assert allocate(flat[:2], 32, ratio=4.0, k_min=2, k_max=32) == [16, 16]
    assert allocate(flat[:2], 0, ratio=4.0) == [0, 0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k_min=3, k_max=2"):
        allocate([[0.0, 0.0]], 4, 1.0, k_min=3)
    with pytest.raises(ValueError, match="needs k_max=4 points"):
        allocate([[0.0] * 4, [0.0] * 2], 4, 1.0, k_max=4)
    with pytest.raises(ValueError, match="budget=-1"):
        allocate([[0.0] * 4], -1, 1.0)
    with pytest.raises(ValueError, match="2 prompts need as many non-negative signals"):
        allocate([[0.0] * 4] * 2, 4, 1.0, signals=[1.0])
