"""rollout.allocation: per_prompt (probes/allocation.py): the first round, the plan from the reward history, the
history's state, the join of a prompt's two rounds into one group, and what a step of unequal groups estimates."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rl_training.algs.common import group_advantages
from rl_training.probes.advisor import group_waste
from rl_training.probes.allocation import HISTORY, PromptAllocator, allocate, reward_variance
from rl_training.rollout.base import Rollouts, StepBatch
from rl_training.rollout.refill import Scored, concat, select_groups
from rl_training.tasks.base import Scores


@pytest.mark.parametrize("p", [0.2, 0.5, 0.9])
def test_a_group_of_k_estimates_k_minus_one_times_its_prompt_s_gradient(p):
    # The derivation behind the constant Dr-GRPO normaliser under unequal groups (probes/allocation.py). A Bernoulli
    # policy with logit theta: reward r ~ Bernoulli(p), d log pi(r) / d theta = r - p, and J = p, dJ/dtheta = p(1-p).
    # A group of k with the group-mean baseline: E[sum_j (r_j - mean r)(r_j - p)] = sum_j Var(r_j)(1 - 1/k)
    # = (k - 1) p (1 - p). Enumerated exactly over every outcome of groups of 2, 3 and 5 in one unequal batch.
    sizes = (2, 3, 5)
    expected = {g: 0.0 for g in range(len(sizes))}
    for outcome in itertools.product((0.0, 1.0), repeat=sum(sizes)):
        r = torch.tensor(outcome, dtype=torch.float64)
        prob = math.prod(p if x else 1 - p for x in outcome)
        adv = group_advantages(r, list(sizes))
        for g, terms in enumerate((adv * (r - p)).split(list(sizes))):
            expected[g] += prob * float(terms.sum())
    for g, k in enumerate(sizes):
        assert expected[g] == pytest.approx((k - 1) * p * (1 - p), abs=1e-12), (k, expected[g])


def test_the_first_round_goes_to_prompts_never_seen():
    a = PromptAllocator(group_size=4, first=2, k_max=0, ratio=0.0)
    assert a.k_max == 8 and a.ratio == 4.0  # 0s: 2 x group_size, and group_size
    assert a.first_round([3, 5]) == [2, 2]
    a.record([(3, [1.0, 0.0])])
    assert a.first_round([3, 5]) == [0, 2]


def test_the_plan_spends_the_budget_by_the_history_and_the_first_round():
    # prompt 7 seen half solved, prompt 8 seen always solved; prompt 9 new with a first round of [0, 1]. The plan
    # is probes/allocation.py's optimum over those rewards, the first round kept: a budget of 3 x 4 = 12.
    a = PromptAllocator(group_size=4, first=2, k_max=8, ratio=4.0)
    a.record([(7, [0.0, 1.0] * 4), (8, [1.0] * 8)])
    ks = a.plan([7, 8, 9], [[], [], [0.0, 1.0]])
    seen = ([0.0, 1.0] * 4, [1.0] * 8, [0.0, 1.0])
    want = allocate([group_waste(r, 8) for r in seen], 12, 4.0, 2, 8, [reward_variance(r) for r in seen], [0, 0, 2])
    assert ks == want and sum(ks) == 12 and ks[2] >= 2 and ks[0] > ks[1]


def test_the_history_keeps_the_last_rewards_and_survives_a_checkpoint():
    a = PromptAllocator(4, 2, 8, 0.0)
    a.record([(1, [float(i) for i in range(HISTORY + 3)])])
    assert a.history[1] == [float(i) for i in range(3, HISTORY + 3)]
    b = PromptAllocator(4, 2, 8, 0.0, state=a.state_dict())
    assert b.history == a.history and b.plan([1, 2], [[], [0.0, 1.0]]) == a.plan([1, 2], [[], [0.0, 1.0]])


def test_a_first_round_beyond_k_max_is_refused():
    with pytest.raises(ValueError, match="first round"):
        PromptAllocator(4, 9, 8, 0.0)


def _scored(indices, sizes, tag):
    n = sum(sizes)
    ro = Rollouts(
        [[1]] * n, [[tag, r] for r in range(n)], [[0.0, 0.0]] * n, [False] * n, [f"{tag}{r}" for r in range(n)]
    )
    rewards = [float(tag + r) for r in range(n)]
    ex = [f"ex{i}" for i, k in zip(indices, sizes, strict=True) for _ in range(k)]
    return Scored(StepBatch(indices, ro, 4, ex, list(sizes)), Scores(rewards, [True] * n, [True] * n), rewards)


def test_a_prompt_s_two_rounds_join_into_one_group():
    # first round: prompts 10 and 30 (2 each); the rest: 10 gets 3 more, 20 (seen, no first round) 4, 30 none
    first, rest = _scored([10, 30], [2, 2], 100), _scored([10, 20], [3, 4], 200)
    parts = [select_groups(first, [0]), select_groups(rest, [0]), select_groups(rest, [1]), select_groups(first, [1])]
    out = concat(parts, [5, 4, 2])
    assert out.batch.indices == [10, 20, 30] and out.batch.groups.sizes == (5, 4, 2)
    assert out.rewards == [100.0, 101.0, 200.0, 201.0, 202.0, 203.0, 204.0, 205.0, 206.0, 102.0, 103.0]
    assert out.batch.examples == ["ex10"] * 5 + ["ex20"] * 4 + ["ex30"] * 2
    with pytest.raises(ValueError, match="groups"):
        StepBatch([1, 2], out.batch.rollouts, 4, out.batch.examples, [5, 5])
