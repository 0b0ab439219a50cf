"""The rollout-budget advisor: how many completions per prompt (K) and prompts per step (B) for a completion budget.

Spec: docs/probes.md 10. Two-stage sampling (Cochran 1977, ch. 10): with between- and within-prompt noise
tr S_b, tr S_w (anova.py), per-prompt cost c_p and per-completion cost c_r, the step's noise-to-signal is
proportional to (tr S_b + tr S_w / K) / (B (1 - w(K))) at cost B (c_p + c_r K), where w(K) = mean over prompts of
p^K + (1 - p)^K is GRPO's zero-advantage waste (a group whose completions all got the same reward teaches
nothing). Variance times cost,
    f(K) = (tr S_b + tr S_w / K) (c_p + c_r K) / (1 - w(K)),
does not depend on B, so the best K is the same for any budget, and B* = budget / K*. Without waste f is convex
with minimum at K* = sqrt((c_p / c_r) (tr S_w / tr S_b)). This departs from the classical formula in the
(1 - w) factor only; it assumes S_b, S_w (of the informative groups) and |G| do not change with K.
Pure functions of floats; the caller supplies the smoothed estimates and the measured costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

# "Far" from the recommendation (docs/probes.md 10.3): the current K costs at least 1/FAR_EFFICIENCY = 1.25 x
# the variance x cost of K*, and the +-2 SE band of K* excludes it.
FAR_EFFICIENCY = 0.8


def waste_fraction(pass_rates: Sequence[float], k: int) -> float:
    """Expected fraction of groups of K completions with one reward for all: mean of p^K + (1 - p)^K (binary
    rewards, pass rate p per prompt); 0 for no pass rates (waste ignored)."""
    if not pass_rates:
        return 0.0
    return sum(p**k + (1 - p) ** k for p in pass_rates) / len(pass_rates)


def group_waste(rewards: Sequence[float], k_max: int) -> list[float]:
    """A prompt's smoothed chance that k completions all get one reward, for k = 1..k_max, from its group's K
    rewards (docs/probes.md 10.2): Laplace's rule over the distinct values seen, q_v = (n_v + 1)/(K + m) for m
    >= 2 values; one value seen (all K equal) keeps an unseen second outcome, q = (K + 1)/(K + 2) and 1/(K + 2).
    Then w(k) = sum_v q_v^k. For binary rewards with s successes this is p^k + (1 - p)^k at the Laplace
    rate p = (s + 1)/(K + 2); a reward no other completion shares adds little (q_v^k with q_v = 2/(K + m)).
    Total on any finite rewards (values are compared exactly: a zero advantage needs exactly equal rewards)."""
    n = len(rewards)
    if n == 0:
        return [0.0] * k_max
    counts: dict[float, int] = {}
    for r in rewards:
        counts[r] = counts.get(r, 0) + 1
    if len(counts) == 1:
        q = [(n + 1) / (n + 2), 1 / (n + 2)]
    else:
        q = [(c + 1) / (n + len(counts)) for c in counts.values()]
    return [sum(v**k for v in q) for k in range(1, k_max + 1)]


@dataclass(frozen=True)
class SplitCosts:
    """What the best split depends on besides the noise: the costs, the pass rates and the bounds on K."""

    c_prompt: float  # cost per prompt (prefill and fixed per-prompt work), any unit shared with c_rollout
    c_rollout: float  # cost per completion (decode, scoring, its share of the training step)
    pass_rates: tuple[float, ...] = ()  # per prompt, for the zero-advantage waste; () ignores waste
    k_min: int = 2
    k_max: int = 64
    # w(k) for k = 1..len measured directly (the mean of group_waste over prompts); replaces pass_rates and
    # bounds k_max by its length
    waste_by_k: tuple[float, ...] = ()

    def waste(self, k: int) -> float:
        """w(K): the expected fraction of groups of K completions that teach nothing."""
        if self.waste_by_k:
            return self.waste_by_k[k - 1]
        return waste_fraction(self.pass_rates, k)

    @property
    def has_waste(self) -> bool:
        return bool(self.waste_by_k or self.pass_rates)


def variance_cost(k: int, trace_between: float, trace_within: float, costs: SplitCosts) -> float:
    """f(K): the step's gradient variance (per unit signal, up to a constant) times its cost; inf when every
    group would be wasted."""
    keep = 1 - costs.waste(k)
    if keep <= 0:
        return math.inf
    return (trace_between + trace_within / k) * (costs.c_prompt + costs.c_rollout * k) / keep


def k_star_continuous(trace_between: float, trace_within: float, costs: SplitCosts) -> float:
    """sqrt((c_p / c_r) (tr S_w / tr S_b)), the unconstrained optimum without waste; inf when tr S_b <= 0."""
    if trace_between <= 0:
        return math.inf
    return math.sqrt(costs.c_prompt * max(trace_within, 0.0) / (costs.c_rollout * trace_between))


def best_k(trace_between: float, trace_within: float, costs: SplitCosts) -> int:
    """The integer K in [k_min, k_max] minimising f. Without waste from the closed form (f is convex: the
    better of floor and ceil of K*, clipped); with waste by evaluating f at every K in the range."""
    k_min, k_max = costs.k_min, costs.k_max
    if costs.has_waste:
        return min(range(k_min, k_max + 1), key=lambda k: variance_cost(k, trace_between, trace_within, costs))
    ks = k_star_continuous(trace_between, trace_within, costs)
    lo = min(max(math.floor(min(ks, k_max)), k_min), k_max)
    hi = min(lo + 1, k_max)
    return min((lo, hi), key=lambda k: variance_cost(k, trace_between, trace_within, costs))  # lo on ties


def critical_rollouts(
    k: int, trace_between: float, trace_within: float, grad_sq_norm: float, pass_rates=(), waste: float | None = None
) -> float:
    """The noise scale in completions per step at K: (K tr S_b + tr S_w) / (|G|^2 (1 - w(K))), i.e. B_simple
    in groups (tr Sigma_g / |G|^2 over the informative fraction) times K. NaN unless |G|^2 > 0. `waste`: w(K)
    given directly (else from `pass_rates`)."""
    keep = 1 - (waste_fraction(pass_rates, k) if waste is None else waste)
    if not grad_sq_norm > 0 or keep <= 0:
        return math.nan
    return (k * trace_between + trace_within) / (grad_sq_norm * keep)


@dataclass(frozen=True)
class Advice:
    k_star: float  # recommended completions per prompt (NaN when there is no estimate)
    b_star: float  # prompts per step for the budget at K*
    k_lo: float  # K* at the ratio band's ends (k_min / k_max where the band is open)
    k_hi: float
    efficiency: float  # f(K*) / f(K current) in (0, 1]: the current split's variance x cost relative to the best
    critical_rollouts: float  # at K*
    far: bool  # trusted, K outside [k_lo, k_hi] and efficiency < FAR_EFFICIENCY: the alert
    trusted: bool


def advise(
    estimate: dict[str, float],
    ratio_band: tuple[float, float],
    trusted: bool,
    costs: SplitCosts,
    *,
    current_k: int,
    completions_per_step: int,
    b_multiple: int = 1,
) -> Advice:
    """K*, B* and the far-from-recommendation flag from AnovaState's `estimate`, `ratio_band` and `trusted`.
    B* = completions_per_step // K* rounded down to a multiple of b_multiple (at least b_multiple). K* is
    monotone in the ratio tr S_w / tr S_b (f depends on it and the costs only), so the ratio's band maps to
    a band of K*."""
    sb, sw, g2 = estimate["trace_between"], estimate["trace_within"], estimate["grad_sq_norm"]
    k_max = min(costs.k_max, completions_per_step, len(costs.waste_by_k) or costs.k_max)
    costs = replace(costs, k_max=k_max, k_min=min(costs.k_min, k_max))
    nan = math.nan
    if not (sb > 0 and sw >= 0 and costs.c_prompt >= 0 and costs.c_rollout > 0):
        return Advice(nan, nan, nan, nan, nan, nan, False, False)
    k = best_k(sb, sw, costs)

    def k_at(ratio: float) -> float:
        if math.isnan(ratio):
            return nan
        return float(costs.k_max if ratio == math.inf else best_k(1.0, ratio, costs))

    k_lo, k_hi = k_at(ratio_band[0]), k_at(ratio_band[1])
    eff = variance_cost(k, sb, sw, costs) / variance_cost(current_k, sb, sw, costs)
    outside = not (k_lo <= current_k <= k_hi)  # NaN ends (warm-up) compare False: "outside", but not trusted
    b = max(b_multiple, completions_per_step // k // b_multiple * b_multiple)
    crit = critical_rollouts(k, sb, sw, g2, waste=costs.waste(k))
    return Advice(float(k), float(b), k_lo, k_hi, eff, crit, trusted and outside and eff < FAR_EFFICIENCY, trusted)
