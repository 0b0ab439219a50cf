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


@dataclass(frozen=True)
class SplitCosts:
    """What the best split depends on besides the noise: the costs, the pass rates and the bounds on K."""

    c_prompt: float  # cost per prompt (prefill and fixed per-prompt work), any unit shared with c_rollout
    c_rollout: float  # cost per completion (decode, scoring, its share of the training step)
    pass_rates: tuple[float, ...] = ()  # per prompt, for the zero-advantage waste; () ignores waste
    k_min: int = 2
    k_max: int = 64


def variance_cost(k: int, trace_between: float, trace_within: float, costs: SplitCosts) -> float:
    """f(K): the step's gradient variance (per unit signal, up to a constant) times its cost; inf when every
    group would be wasted."""
    keep = 1 - waste_fraction(costs.pass_rates, k)
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
    if costs.pass_rates:
        return min(range(k_min, k_max + 1), key=lambda k: variance_cost(k, trace_between, trace_within, costs))
    ks = k_star_continuous(trace_between, trace_within, costs)
    lo = min(max(math.floor(min(ks, k_max)), k_min), k_max)
    hi = min(lo + 1, k_max)
    return min((lo, hi), key=lambda k: variance_cost(k, trace_between, trace_within, costs))  # lo on ties


def critical_rollouts(k: int, trace_between: float, trace_within: float, grad_sq_norm: float, pass_rates=()) -> float:
    """The noise scale in completions per step at K: (K tr S_b + tr S_w) / (|G|^2 (1 - w(K))), i.e. B_simple
    in groups (tr Sigma_g / |G|^2 over the informative fraction) times K. NaN unless |G|^2 > 0."""
    keep = 1 - waste_fraction(pass_rates, k)
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
    costs = replace(costs, k_max=min(costs.k_max, completions_per_step))
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
    crit = critical_rollouts(k, sb, sw, g2, costs.pass_rates)
    return Advice(float(k), float(b), k_lo, k_hi, eff, crit, trusted and outside and eff < FAR_EFFICIENCY, trusted)
