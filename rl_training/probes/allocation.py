"""Completions per prompt, chosen per prompt (rollout.allocation: per_prompt; issue 52, item 2; docs/probes.md 10.5).

A step holds n prompts and a budget of N completions. Prompt i gets k_i completions, 0 or k_min..k_max, with
sum k_i <= N, chosen to maximise the expected gradient signal sum_i v_i(k_i), the rollout-budget advisor's model
(advisor.py) taken prompt by prompt:

    v_i(k) = s_i * (1 - w_i(k)) * k / (k + r),        r = tr S_w / tr S_b

- k / (k + r) is the precision of a group's gradient estimate, 1 / (tr S_b + tr S_w / k), in units of 1 / tr S_b:
  a prompt's information saturates once its own completions have averaged the within-prompt noise below the
  between-prompt noise, so the next completion is worth more on another prompt;
- 1 - w_i(k) is the chance that the group is informative: w_i(k) is the chance that its k completions all get one
  reward (zero advantage, nothing learned), p^k + (1 - p)^k for a binary reward with pass rate p (VIP's p(1 - p):
  the waste is smallest at p = 1/2), estimated per prompt from the rewards it got (advisor.group_waste);
- s_i is the size of an informative group's signal, its advantages' scale: the prompt's reward variance, p (1 - p)
  for a pass rate p (VIP, arXiv 2602.01601: a prompt's gradient variance is proportional to it), Laplace-smoothed
  from the rewards it got (`reward_variance`). Without it the waste term alone would spend the most on the prompts
  nearly always solved or never, whose rare informative group is one odd completion among k.

For n identical prompts this is the advisor's own objective: n prompts of k completions give n v(k) = N v(k) / k,
and v(k) / k = s (1 - w(k)) / (k tr S_b + tr S_w) (times tr S_b) is s / f(k) of advisor.variance_cost at zero
per-prompt cost. So with prompts to spare, every prompt used gets the advisor's K* (tests/unit/probes).

The optimum is exact, not greedy: v_i need not be concave (the waste term is not, and 0 -> k_min is a jump), so
`allocate` solves the knapsack by dynamic programming over the budget, O(n N (k_max - k_min)) vector steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from rl_training.probes.advisor import group_waste


def reward_variance(rewards: Sequence[float]) -> float:
    """s = m (1 - m) at the Laplace-smoothed mean reward m = (sum r + 1) / (n + 2), rewards clipped to [0, 1]: a
    binary reward's variance at its smoothed pass rate (1/4 for a prompt not seen yet)."""
    m = (sum(min(max(r, 0.0), 1.0) for r in rewards) + 1) / (len(rewards) + 2)
    return m * (1 - m)


def group_value(k: int, waste: float, ratio: float, signal: float = 1.0) -> float:
    """v(k): the expected signal of a group of k completions whose chance of all-equal rewards is `waste` and
    whose informative group's signal is `signal` (s)."""
    if k <= 0:
        return 0.0
    return signal * (1.0 - waste) * k / (k + ratio)


def allocate(
    wastes: Sequence[Sequence[float]],
    budget: int,
    ratio: float,
    k_min: int = 2,
    k_max: int = 0,
    signals: Sequence[float] | None = None,
    given: Sequence[int] | None = None,
) -> list[int]:
    """Completions for each prompt: `wastes[i][k - 1]` = w_i(k) for k = 1..len (each prompt's curve at least k_max
    long; advisor.group_waste) and `signals[i]` = s_i (reward_variance; None: all 1), at most `budget` in all,
    each 0 or in [k_min, k_max] (k_max 0: the curves' length). `given[i]` > 0: prompt i already has that many
    (a first round's), counted in the budget; it gets given[i] or any k in [max(k_min, given[i]), k_max].
    Maximises sum_i v_i(k_i) exactly; among equal values, the fewer completions (and the earlier prompts'
    allocations smaller first)."""
    n = len(wastes)
    signals = [1.0] * n if signals is None else list(signals)
    given = [0] * n if given is None else list(given)
    if len(signals) != n or not all(s >= 0 for s in signals):
        raise ValueError(f"allocate: {n} prompts need as many non-negative signals, got {signals}")
    k_max = k_max or min((len(w) for w in wastes), default=0)
    if k_min < 1 or k_max < k_min or budget < 0 or ratio < 0:
        raise ValueError(f"allocate: k_min={k_min}, k_max={k_max}, budget={budget}, ratio={ratio}")
    if any(len(w) < k_max for w in wastes):
        raise ValueError(f"allocate: every waste curve needs k_max={k_max} points")
    if len(given) != n or any(not 0 <= g <= k_max for g in given) or sum(given) > budget:
        raise ValueError(f"allocate: given={given} must be 0..k_max={k_max} each and at most budget={budget}")
    best = np.zeros(budget + 1)  # best[j]: the most value with at most j completions over the prompts so far
    choice = np.zeros((n, budget + 1), dtype=np.int64)
    for i, w in enumerate(wastes):
        g = given[i]
        new = np.full(budget + 1, -np.inf)  # the prompt keeps what it was given (0: sits the step out)
        new[g:] = best[: budget + 1 - g] + group_value(g, w[g - 1] if g else 0.0, ratio, signals[i])
        choice[i] = g
        for k in range(max(k_min, g + 1), min(k_max, budget) + 1):
            cand = np.full(budget + 1, -np.inf)
            cand[k:] = best[: budget + 1 - k] + group_value(k, w[k - 1], ratio, signals[i])
            better = cand > new + 1e-12  # strictly better: ties keep the smaller k
            new = np.where(better, cand, new)
            choice[i] = np.where(better, k, choice[i])
        best = new
    out, j = [0] * n, budget
    for i in range(n - 1, -1, -1):
        out[i] = int(choice[i, j])
        j -= out[i]
    return out


def allocation_value(
    ks: Sequence[int], wastes: Sequence[Sequence[float]], ratio: float, signals: Sequence[float] | None = None
) -> float:
    """sum_i v_i(k_i): what `allocate` maximises."""
    signals = [1.0] * len(ks) if signals is None else signals
    return sum(group_value(k, w[k - 1] if k else 0.0, ratio, s) for k, w, s in zip(ks, wastes, signals, strict=True))


# ------------------------------------------------------------------------------ in the step: rollout.allocation
# Completions per prompt, chosen per prompt (rollout.allocation: per_prompt; issue 52, item 2; docs/probes.md 10.7).
#
# A step's P prompts on a rank share the fixed split's budget of N = P G completions (rollout.group_size G):
# 1. The first round (rl_batch.generate_step): a prompt with no reward history gets rollout.allocation_first
#    completions, its cheap estimate; a prompt seen before gets none.
# 2. The plan (`PromptAllocator.plan`): `allocate`'s exact knapsack over the budget, with each prompt's waste
#    curve and signal from its history and its first round. A first-round prompt keeps what it got; a seen prompt may
#    get 0 and sit the step out.
# 3. The rest (rl_batch.allocate_step): one generate call of the completions each prompt still needs; each prompt's
#    two rounds join into one group.
#
# What the step then estimates. Dr-GRPO's normaliser stays the constant c = N L_max, and a group of k completions
# with the group-mean baseline has expected gradient sum_j E[(r_j - mean r) grad log pi_j] = (k - 1) grad J_i (the
# baseline's own completion takes 1/k of each term). So the step's expected gradient is (1/c) sum_i (k_i - 1) grad J_i:
# the fixed split weighs every prompt by G - 1, per_prompt weighs prompt i by k_i - 1, more where its rewards are
# likelier to differ. tests/unit/rollout/test_allocate.py checks the identity exactly on a Bernoulli policy.
#
# The history: the last HISTORY rewards of every prompt seen, gathered over ranks every step, so every rank holds the
# same and a resume restores it (the checkpoint's "allocation" state), with the within/between-prompt ratio r the
# plan uses (rollout.allocation_ratio, or group_size until set).

HISTORY = 16  # rewards kept per prompt: recent enough to follow the policy, enough for Laplace's rule


class PromptAllocator:
    """Per-prompt reward history and the plan it makes (the comment above)."""

    @classmethod
    def from_config(cls, rollout, state: dict | None) -> PromptAllocator | None:
        """rollout.allocation: per_prompt's allocator (`state`: a checkpoint's), or None for the fixed split."""
        r = rollout
        if r.allocation != "per_prompt":
            return None
        return cls(r.group_size, r.allocation_first, r.allocation_k_max, r.allocation_ratio, state)

    def __init__(self, group_size: int, first: int, k_max: int, ratio: float, state: dict | None = None):
        self.G, self.first, self.k_max = group_size, first, k_max or 2 * group_size
        self.ratio = ratio or float(group_size)
        if not 1 <= self.first <= self.k_max or self.k_max < 2:
            raise ValueError(f"allocation: first round {self.first} must be in 1..k_max={self.k_max}")
        state = state or {}
        self.history: dict[int, list[float]] = {int(k): list(v) for k, v in state.get("history", {}).items()}

    def first_round(self, indices: Sequence[int]) -> list[int]:
        """Completions each prompt gets before the plan: `first` for a prompt never seen, 0 for one seen."""
        return [0 if i in self.history else self.first for i in indices]

    def plan(self, indices: Sequence[int], first_rewards: Sequence[Sequence[float]]) -> list[int]:
        """Each prompt's completions in all (its first round's included), spending the P G budget."""
        seen = [self.history.get(i, []) + list(r) for i, r in zip(indices, first_rewards, strict=True)]
        wastes = [group_waste(r, self.k_max) for r in seen]
        signals = [reward_variance(r) for r in seen]
        given = [len(r) for r in first_rewards]
        return allocate(wastes, len(indices) * self.G, self.ratio, 2, self.k_max, signals, given=given)

    def record(self, pairs: Iterable[tuple[int, Sequence[float]]]) -> None:
        """Add each (prompt, rewards) of a step, all ranks' in rank order (the same on every rank)."""
        for i, rewards in pairs:
            h = self.history.setdefault(int(i), [])
            h.extend(float(r) for r in rewards)
            del h[:-HISTORY]

    def state_dict(self) -> dict:
        return {"history": {str(k): v for k, v in self.history.items()}}
