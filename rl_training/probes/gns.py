"""Gradient noise scale (McCandlish et al. 2018, arXiv:1812.06162), as pure functions and a small state.

Spec: ../shared/docs/GNS_ESS.md (sections 1.3-1.6). The sampling unit is the prompt group. Each optimizer step
gives K "small" gradients g_k (each the mean of b_k units; disjoint units, so independent) and the big
gradient G_B = sum_k c_k g_k actually applied (trainable parameters, all-reduced, before clipping). With
    S = (1/K) sum_k |g_k|^2,   Q = |G_B|^2,   a = (1/K) sum_k 1/b_k,   beta = sum_k c_k^2 / b_k
the unbiased per-step estimates are
    trSigma = (S - Q)/(a - beta),     |G|^2 = (a Q - beta S)/(a - beta)          (need a > beta, K >= 2).
They are kept raw (possibly negative), smoothed separately with bias-corrected EMAs, and only then divided:
B_simple = trSigma_ema / |G|^2_ema, in prompt groups. Never an EMA of per-step ratios (biased, heavy-tailed).
Everything here is float64 and free of torch.distributed: the caller all-reduces the sums first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SmallBatchSums:
    """Sums over the small gradients of one step, over all ranks (the caller all-reduces them)."""

    sq_norm_sum: float  # sum_k |g_k|^2, each g_k already normalised to a per-unit mean gradient
    k: float  # number of small gradients K
    inv_b_sum: float  # sum_k 1/b_k
    c2_over_b_sum: float  # sum_k c_k^2 / b_k

    def __add__(self, other: SmallBatchSums) -> SmallBatchSums:
        return SmallBatchSums(
            self.sq_norm_sum + other.sq_norm_sum,
            self.k + other.k,
            self.inv_b_sum + other.inv_b_sum,
            self.c2_over_b_sum + other.c2_over_b_sum,
        )


@dataclass(frozen=True)
class RawEstimate:
    trace_sigma: float  # unbiased estimate of tr(Sigma) per unit
    grad_sq_norm: float  # unbiased estimate of |G|^2
    s_bar: float
    q: float
    a: float
    beta: float
    k: float


def two_batch_estimate(sums: SmallBatchSums, big_sq_norm: float) -> RawEstimate | None:
    """The general weighted two-batch estimator (GNS_ESS.md 1.3); None when it is not identifiable."""
    if sums.k < 2:
        return None
    s_bar = sums.sq_norm_sum / sums.k
    a = sums.inv_b_sum / sums.k
    beta = sums.c2_over_b_sum
    if not a > beta:
        return None
    tr = (s_bar - big_sq_norm) / (a - beta)
    g2 = (a * big_sq_norm - beta * s_bar) / (a - beta)
    if not (math.isfinite(tr) and math.isfinite(g2)):
        return None
    return RawEstimate(tr, g2, s_bar, big_sq_norm, a, beta, sums.k)


def ema_n_eff(beta: float, t: int) -> float:
    """Kish ESS of the EMA weights after t updates: (1-b^t)^2 (1+b) / ((1-b)(1-b^2t)) -> (1+b)/(1-b)."""
    if t <= 0:
        return 0.0
    if beta == 0.0:
        return 1.0
    return (1 - beta**t) ** 2 * (1 + beta) / ((1 - beta) * (1 - beta ** (2 * t)))


# Round-off of a zero noise estimate: S - Q of identical small gradients is ~1e-16 S, so trSigma_ema within
# this fraction of the per-step scale max(S, Q)/(a - beta) is zero (B_simple = 0), not a negative (NaN) value.
ZERO_TRACE_RTOL = 1e-12


@dataclass
class GNSState:
    """Bias-corrected EMAs of the raw (trSigma, |G|^2) pair and of their second moments (for the SE).

    `window` > 0 switches to the spec's window-sum mode (GNS_ESS.md 1.4, for tests and offline checks): plain
    sums over the last `window` updates, reset every `window` updates, so B_simple is the ratio of the
    window's sums and N_eff is the number of steps in it. `beta` is then unused by the smoothing."""

    beta: float = 0.95
    window: int = 0
    t: int = 0
    m_tr: float = 0.0
    m_g2: float = 0.0
    m_tr2: float = 0.0
    m_g22: float = 0.0
    m_trg2: float = 0.0
    m_scale: float = 0.0  # smoothed max(S, Q)/(a - beta): the size of trSigma's round-off, ZERO_TRACE_RTOL
    skipped: int = 0  # steps whose estimate was non-finite or not identifiable
    valid_steps: int = 0  # updates after which the estimate was valid (the recommendation's warm-up counts these)

    def update(self, est: RawEstimate | None) -> None:
        if est is None:
            self.skipped += 1
            return
        self._update(est)
        self.valid_steps += self.valid

    def _update(self, est: RawEstimate) -> None:
        if self.window and self.t == self.window:
            self.t = 0
            self.m_tr = self.m_g2 = self.m_tr2 = self.m_g22 = self.m_trg2 = self.m_scale = 0.0
        b, w = (1.0, 1.0) if self.window else (self.beta, 1 - self.beta)
        self.t += 1
        self.m_tr = b * self.m_tr + w * est.trace_sigma
        self.m_g2 = b * self.m_g2 + w * est.grad_sq_norm
        self.m_tr2 = b * self.m_tr2 + w * est.trace_sigma**2
        self.m_g22 = b * self.m_g22 + w * est.grad_sq_norm**2
        self.m_trg2 = b * self.m_trg2 + w * est.trace_sigma * est.grad_sq_norm
        self.m_scale = b * self.m_scale + w * max(est.s_bar, est.q) / (est.a - est.beta)

    def _bc(self, m: float) -> float:
        """The bias-corrected EMA (or the window mean) of a smoothed sum."""
        if not self.t:
            return float("nan")
        return m / self.t if self.window else m / (1 - self.beta**self.t)

    @property
    def trace_sigma(self) -> float:
        return self._bc(self.m_tr)

    @property
    def grad_sq_norm(self) -> float:
        return self._bc(self.m_g2)

    def _trace_sigma_or_zero(self) -> float:
        tr = self.trace_sigma
        return 0.0 if abs(tr) <= ZERO_TRACE_RTOL * self._bc(self.m_scale) else tr

    @property
    def valid(self) -> bool:
        """|G|^2_ema > 0 (the spec's rule), and also trSigma_ema >= 0 up to round-off: a negative noise estimate
        would give a negative B_simple, which is shown as NaN too rather than as a number."""
        return self.t > 0 and self.grad_sq_norm > 0 and self._trace_sigma_or_zero() >= 0

    @property
    def b_simple(self) -> float:
        return self._trace_sigma_or_zero() / self.grad_sq_norm if self.valid else float("nan")

    @property
    def n_eff(self) -> float:
        return float(self.t) if self.window else ema_n_eff(self.beta, self.t)

    @property
    def b_simple_rel_se(self) -> float:
        """Delta-method relative SE of B_simple from the per-step variances and covariance (GNS_ESS.md 1.4)."""
        if not self.valid or self.t < 2:
            return float("nan")
        tr, g2 = self._trace_sigma_or_zero(), self.grad_sq_norm
        v_tr = max(self._bc(self.m_tr2) - tr * tr, 0.0)
        v_g2 = max(self._bc(self.m_g22) - g2 * g2, 0.0)
        c = self._bc(self.m_trg2) - tr * g2
        rel2 = (v_tr / tr**2 if tr > 0 else 0.0) + v_g2 / g2**2 - (2 * c / (tr * g2) if tr > 0 else 0.0)
        return math.sqrt(max(rel2, 0.0) / self.n_eff)


@dataclass(frozen=True)
class Recommendation:
    batch: float  # recommended prompt groups per step (NaN until the estimate is trustworthy)
    reason: str


def b_star(b_simple: float, t_fixed: float, t_per_unit: float) -> float:
    """Goodput-optimal batch on fixed hardware (GNS_ESS.md 1.6): with step time t_f + t_u B, progress per second
    ~ B / ((B + B_simple)(t_f + t_u B)) peaks at B* = sqrt(B_simple t_f / t_u). NaN if an input is unknown."""
    if not (b_simple > 0 and t_fixed > 0 and t_per_unit > 0):
        return float("nan")
    return math.sqrt(b_simple * t_fixed / t_per_unit)


def fit_step_time(batches: list[float], step_times: list[float]) -> tuple[float, float]:
    """Least-squares (t_f, t_u) of step_time = t_f + t_u * B over measurements at >= 2 distinct batch sizes."""
    n = len(batches)
    if n != len(step_times) or len(set(batches)) < 2:
        raise ValueError("fit_step_time needs step times at two or more distinct batch sizes")
    mb, mt = sum(batches) / n, sum(step_times) / n
    t_u = sum((b - mb) * (t - mt) for b, t in zip(batches, step_times, strict=True)) / sum(
        (b - mb) ** 2 for b in batches
    )
    return mt - t_u * mb, t_u


def recommend_batch(
    state: GNSState,
    current: int,
    multiple: int,
    b_min: int,
    b_max: int,
    kappa: float = 1.0,
    max_rel_se: float = 0.3,
    target: float | None = None,
) -> Recommendation:
    """`target` (default kappa * B_simple; pass B* for the goodput-optimal variant), clipped to [b_min, b_max],
    within x2 / /2 of the current batch, rounded to a multiple of `multiple`. Only after 3/(1-beta) updates with
    a valid estimate and rel_se <= max_rel_se. Recommend only."""
    need = math.ceil(3 / (1 - state.beta)) if state.beta < 1 else 10**9
    if not state.valid or state.valid_steps < need:
        return Recommendation(float("nan"), f"warming up ({state.valid_steps}/{need} valid steps)")
    if not state.b_simple_rel_se <= max_rel_se:
        return Recommendation(float("nan"), f"B_simple too uncertain (rel SE {state.b_simple_rel_se:.2f})")
    want = kappa * state.b_simple if target is None else target
    if not math.isfinite(want):
        return Recommendation(float("nan"), "no target")
    clipped = min(max(want, b_min, current / 2), b_max, current * 2)
    rounded = max(multiple, round(clipped / multiple) * multiple)
    return Recommendation(float(rounded), "ok")


@dataclass
class Hysteresis:
    """Hold a recommendation for at least `hold` steps before it may change (GNS_ESS.md 1.6: at most every R
    steps), so a noisy estimate near a rounding boundary does not flip the advice every step."""

    hold: int
    value: float = float("nan")
    since: int = 0

    def __call__(self, proposed: float) -> float:
        self.since += 1
        if math.isnan(proposed):
            self.value, self.since = float("nan"), 0  # advice withdrawn (warming up or too uncertain)
        elif math.isnan(self.value) or (proposed != self.value and self.since >= self.hold):
            self.value, self.since = proposed, 0
        return self.value


@dataclass
class GNSTracker:
    """One GNSState per measurement level (unit, micro, rank); the primary level is the finest available."""

    beta: float = 0.95
    levels: dict[str, GNSState] = field(default_factory=dict)
    last: dict[str, RawEstimate | None] = field(default_factory=dict)

    def update(self, level: str, sums: SmallBatchSums, big_sq_norm: float) -> None:
        est = two_batch_estimate(sums, big_sq_norm)
        self.levels.setdefault(level, GNSState(beta=self.beta)).update(est)
        self.last[level] = est

    def state_dict(self) -> dict:
        return {"beta": self.beta, "levels": {k: vars(v).copy() for k, v in self.levels.items()}}

    def load_state_dict(self, d: dict) -> bool:
        """Restore the levels' EMAs; returns False (and restarts them, keeping only the skipped counts) when
        they were saved with another beta: the configured beta is kept."""
        if d["beta"] != self.beta:
            self.levels = {k: GNSState(beta=self.beta, skipped=v["skipped"]) for k, v in d["levels"].items()}
            return False
        self.levels = {k: GNSState(**v) for k, v in d["levels"].items()}
        return True
