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

from collections.abc import Sequence

import numpy as np


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
) -> list[int]:
    """Completions for each prompt: `wastes[i][k - 1]` = w_i(k) for k = 1..len (each prompt's curve at least k_max
    long; advisor.group_waste) and `signals[i]` = s_i (reward_variance; None: all 1), at most `budget` in all,
    each 0 or in [k_min, k_max] (k_max 0: the curves' length). Maximises sum_i v_i(k_i) exactly; among equal
    values, the fewer completions (and the earlier prompts' allocations smaller first)."""
    n = len(wastes)
    signals = [1.0] * n if signals is None else list(signals)
    if len(signals) != n or not all(s >= 0 for s in signals):
        raise ValueError(f"allocate: {n} prompts need as many non-negative signals, got {signals}")
    k_max = k_max or min((len(w) for w in wastes), default=0)
    if k_min < 1 or k_max < k_min or budget < 0 or ratio < 0:
        raise ValueError(f"allocate: k_min={k_min}, k_max={k_max}, budget={budget}, ratio={ratio}")
    if any(len(w) < k_max for w in wastes):
        raise ValueError(f"allocate: every waste curve needs k_max={k_max} points")
    best = np.zeros(budget + 1)  # best[j]: the most value with at most j completions over the prompts so far
    choice = np.zeros((n, budget + 1), dtype=np.int64)
    for i, w in enumerate(wastes):
        new = best.copy()
        for k in range(k_min, min(k_max, budget) + 1):
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
