"""Between- and within-prompt gradient noise: a nested (one-way random effects) ANOVA, as pure functions and a state.

Spec and derivation: docs/probes.md 9. One step has B prompt groups, group i with k_i completions (every k_i = K
for a fixed split; rollout.allocation: per_prompt's groups differ), N = sum_i k_i. g_ij is completion j's gradient
of group i, scaled so that the step's gradient is their mean, gbar = (1/N) sum_ij g_ij (for equal groups also the
mean of the group gradients gbar_i = (1/K) sum_j g_ij, the GNS unit of docs/probes.md 1.1). The model is
g_ij = G + b_i + e_ij with Cov(b_i) = S_b and Cov(e_ij) = S_w, all terms uncorrelated. From
    S1 = sum_ij |g_ij|^2,   S2 = sum_i |sum_j g_ij|^2 / k_i,   Q = |gbar|^2,   c = sum_i k_i^2 / N^2
whose expectations are
    E S1 = N (|G|^2 + tr S_b + tr S_w),   E S2 = N (|G|^2 + tr S_b) + B tr S_w,
    E Q = |G|^2 + c tr S_b + tr S_w / N,
the unbiased estimates (linear in S1, S2, Q) are
    tr S_w = (S1 - S2) / (N - B),   tr S_b = (S2/N - Q - (B - 1) tr S_w / N) / (1 - c),
    |G|^2 = Q - c tr S_b - tr S_w / N.
For equal groups (N = BK, c = 1/B, S2 = K sum_i |gbar_i|^2) these are the balanced forms
    tr S_w = K (M1 - M2)/(K - 1),   tr Sigma_g = B (M2 - Q)/(B - 1),   tr S_b = tr Sigma_g - tr S_w / K,
    |G|^2 = Q - tr Sigma_g / B,   with M1 = S1/(BK), M2 = (1/B) sum_i |gbar_i|^2,
where tr Sigma_g = tr S_b + tr S_w / K is the per-group noise the GNS unit level measures. Unequal groups assume
nothing more than equal ones: a completion's gradient noise does not depend on its group's size, which the advisor
assumes anyway when it extrapolates to another K. Float64, no torch.distributed: the caller all-reduces the sums
(they add over ranks and micro-batches) first.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field

from rl_training.probes.gns import GNSState, ema_n_eff, fieller_band

QUANTITIES = ("trace_between", "trace_within", "grad_sq_norm")


@dataclass(frozen=True)
class GroupGradSums:
    """One step's sums over whole prompt groups (all ranks, all-reduced): they add over ranks and micro-batches."""

    completion_sq_norm_sum: float  # S1 = sum_ij |g_ij|^2
    group_sq_norm_over_size: float  # S2 = sum_i |sum_j g_ij|^2 / k_i (= K sum_i |gbar_i|^2 for equal groups)
    groups: float  # B
    completions: float  # N = sum_i k_i
    size_sq_sum: float  # sum_i k_i^2

    @classmethod
    def balanced(cls, completion_sq_norm_sum: float, group_mean_sq_norm_sum: float, groups: float, k: int):
        """B groups of K from sum_ij |g_ij|^2 and sum_i |gbar_i|^2."""
        return cls(completion_sq_norm_sum, k * group_mean_sq_norm_sum, groups, groups * k, groups * k * k)

    @property
    def k(self) -> float:
        """The mean group size N / B."""
        return self.completions / self.groups if self.groups else math.nan

    def __add__(self, other: GroupGradSums) -> GroupGradSums:
        return GroupGradSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def group_sums_from_contributions(
    seq_sq_norm_sum: float, group_sq_over_size_sum: float, groups: float, completions: float, size_sq_sum: float,
    scale: float,
) -> GroupGradSums:  # fmt: skip
    """GroupGradSums from what the hooks read: sum_ij |h_ij|^2 of each sequence's contribution h_ij to a rank's
    accumulated gradient, and sum_i |h_i|^2 / k_i of each group's (h_i = sum_j h_ij). The completion gradient is
    g_ij = scale h_ij with scale = N_step / W (the step's completions over the ranks: the DDP gradient is
    (1/W) sum h_ij, the mean of the g_ij; for B K completions scale = K U / W, docs/probes.md 2)."""
    s2 = scale * scale
    return GroupGradSums(s2 * seq_sq_norm_sum, s2 * group_sq_over_size_sum, groups, completions, size_sq_sum)


@dataclass(frozen=True)
class AnovaEstimate:
    trace_between: float  # tr S_b, unbiased, possibly negative
    trace_within: float  # tr S_w, unbiased, >= 0
    grad_sq_norm: float  # |G|^2, unbiased, possibly negative
    trace_group: float  # tr Sigma_g = tr S_b + tr S_w / k, k the mean group size
    groups: float
    k: float  # the mean group size N / B


def nested_anova(sums: GroupGradSums, big_sq_norm: float) -> AnovaEstimate | None:
    """The per-step estimates (docs/probes.md 9.2) from the group sums and Q = |gbar|^2; None when not
    identifiable (B < 2, or no group with two completions) or not finite."""
    n_b, n = sums.groups, sums.completions
    if n_b < 2 or n - n_b < 1:
        return None
    c = sums.size_sq_sum / (n * n)
    tr_w = (sums.completion_sq_norm_sum - sums.group_sq_norm_over_size) / (n - n_b)
    tr_b = (sums.group_sq_norm_over_size / n - big_sq_norm - (n_b - 1) * tr_w / n) / (1 - c)
    k = n / n_b
    est = AnovaEstimate(tr_b, tr_w, big_sq_norm - c * tr_b - tr_w / n, tr_b + tr_w / k, n_b, k)
    if not all(math.isfinite(getattr(est, q)) for q in QUANTITIES):
        return None
    return est


@dataclass
class AnovaState:
    """Bias-corrected EMAs of (tr S_b, tr S_w, |G|^2) and of their products, for standard errors, the band of
    the ratio tr S_w / tr S_b and the advisor's trust gate (the GNS rule of docs/probes.md 1.6)."""

    beta: float = 0.95
    t: int = 0
    m: list = field(default_factory=lambda: [0.0] * 3)  # EMA of each quantity (QUANTITIES order)
    mm: list = field(default_factory=lambda: [0.0] * 9)  # EMA of the products x_a x_b, row-major 3 x 3
    skipped: int = 0
    bounded: list = field(default_factory=list)  # was the ratio band bounded after each of the last lag+1 updates

    def update(self, est: AnovaEstimate | None) -> None:
        if est is None:
            self.skipped += 1
            return
        x = [getattr(est, q) for q in QUANTITIES]
        b, w = self.beta, 1 - self.beta
        self.t += 1
        self.m = [b * mi + w * xi for mi, xi in zip(self.m, x, strict=True)]
        self.mm = [b * self.mm[3 * i + j] + w * x[i] * x[j] for i in range(3) for j in range(3)]
        self.bounded = [*self.bounded, math.isfinite(self._ratio_band()[1])][-(self.lag + 1) :]

    def _bc(self, v: float) -> float:
        return v / (1 - self.beta**self.t) if self.t else math.nan

    @property
    def estimate(self) -> dict[str, float]:
        """The smoothed (tr S_b, tr S_w, |G|^2) by name."""
        return {q: self._bc(v) for q, v in zip(QUANTITIES, self.m, strict=True)}

    @property
    def n_eff(self) -> float:
        return ema_n_eff(self.beta, self.t)

    def covariance(self) -> list[list[float]]:
        """3 x 3 per-step covariance of the raw estimates: the EMA-weighted one, x N_eff/(N_eff - 1)."""
        n, mean = self.n_eff, [self._bc(v) for v in self.m]
        if self.t < 2 or n <= 1:
            return [[math.nan] * 3 for _ in range(3)]
        return [[(self._bc(self.mm[3 * i + j]) - mean[i] * mean[j]) * n / (n - 1) for j in range(3)] for i in range(3)]

    @property
    def per_step_se(self) -> dict[str, float]:
        """The spread of one step's estimate (sd over steps)."""
        c = self.covariance()
        return {q: math.sqrt(max(c[i][i], 0.0)) for i, q in enumerate(QUANTITIES)}

    @property
    def se(self) -> dict[str, float]:
        """Standard error of the smoothed estimates: per-step sd / sqrt(N_eff)."""
        n = self.n_eff
        return {q: s / math.sqrt(n) if n > 0 else math.nan for q, s in self.per_step_se.items()}

    def _ratio_band(self, z: float = 2.0) -> tuple[float, float]:
        c = self.covariance()
        if self.t < 2 or math.isnan(c[0][0]):
            return math.nan, math.nan
        e, n = self.estimate, self.n_eff
        # Fieller on tr S_w / tr S_b: numerator index 1, denominator index 0; variances of the EMA means
        return fieller_band(e["trace_within"], e["trace_between"], c[1][1] / n, c[0][0] / n, c[0][1] / n, z)

    @property
    def ratio(self) -> float:
        """tr S_w / tr S_b (NaN unless tr S_b > 0)."""
        e = self.estimate
        return e["trace_within"] / e["trace_between"] if e["trace_between"] > 0 else math.nan

    @property
    def warmup(self) -> int:
        return GNSState(beta=self.beta).warmup  # the GNS trust rule's constants, stated once in gns.py

    @property
    def lag(self) -> int:
        return GNSState(beta=self.beta).lag

    @property
    def ratio_band(self) -> tuple[float, float]:
        """(lo, hi) of tr S_w / tr S_b at +-2 SE (Fieller; hi = inf while tr S_b is not significantly > 0);
        NaN in the warm-up."""
        return self._ratio_band() if self.t >= self.warmup else (math.nan, math.nan)

    @property
    def trusted(self) -> bool:
        """Past the warm-up, and the ratio band was bounded one EMA window (`lag` updates) ago: the GNS trust
        rule (docs/probes.md 1.6), so the gate does not select steps where tr S_b happens to be overestimated."""
        return self.t >= self.warmup and len(self.bounded) > self.lag and self.bounded[0]

    def state_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items()}

    def load_state_dict(self, d: dict) -> bool:
        """Restore the EMAs; returns False (and restarts them, keeping the skipped count) when they were saved
        with another beta: the configured beta is kept (moments under another beta break the bias correction)."""
        if d["beta"] != self.beta:
            self.__init__(beta=self.beta, skipped=d["skipped"])
            return False
        self.__init__(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})
        return True
