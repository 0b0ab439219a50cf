"""Gradient noise scale (McCandlish et al. 2018, arXiv:1812.06162), as pure functions and a small state.

Spec: docs/probes.md (sections 1.3-1.6). The sampling unit is the prompt group. Each optimizer step
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
    """The general weighted two-batch estimator (docs/probes.md 1.3); None when it is not identifiable."""
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


# The B_simple band is +-Z_BAND standard errors wide: 95.4% nominal coverage for normal EMA errors.
Z_BAND = 2.0


def fieller_band(tr: float, g2: float, v_tr: float, v_g2: float, cov: float, z: float = Z_BAND):
    """Fieller's confidence set for the ratio tr/g2 of two jointly normal estimates (variances v_tr, v_g2 and
    covariance cov of the estimates themselves), intersected with [0, inf): every rho >= 0 with
    (tr - rho g2)^2 <= z^2 Var(tr - rho g2), i.e. a rho^2 - 2 b rho + c <= 0 below. Returns (lo, hi): hi is
    inf when g2 is not significantly above 0 (a <= 0), and (nan, nan) when no rho >= 0 qualifies (g2
    significantly negative). Unlike the delta method it does not divide by the noisy g2 (docs/probes.md 1.6)."""
    a = g2 * g2 - z * z * v_g2
    b = tr * g2 - z * z * cov
    c = tr * tr - z * z * v_tr
    root = math.sqrt(max(b * b - a * c, 0.0))
    if a > 0:  # bounded; the roots have the sign of b when c > 0, and straddle 0 when c <= 0
        if c > 0 and b <= 0:
            return math.nan, math.nan
        return (0.0 if c <= 0 else (b - root) / a), (b + root) / a
    if c <= 0:  # tr not significantly above 0 either: every rho >= 0
        return 0.0, math.inf
    if a == 0:
        return (c / (2 * b), math.inf) if b > 0 else (math.nan, math.nan)
    return (b - root) / a, math.inf  # a < 0 < c: one root of each sign; the set is [positive root, inf)


@dataclass
class GNSState:
    """Bias-corrected EMAs of the raw (trSigma, |G|^2) pair and of their second moments (for the SE).

    `window` > 0 switches to the window-sum mode (docs/probes.md 1.4, for tests and offline checks): plain
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
    valid_steps: int = 0  # updates after which the estimate was valid
    bounded: list = field(default_factory=list)  # was the band bounded after each of the last lag + 1 updates

    def update(self, est: RawEstimate | None) -> None:
        if est is None:
            self.skipped += 1
            return
        self._update(est)
        self.valid_steps += self.valid
        self.bounded = [*self.bounded, math.isfinite(self._band()[1])][-(self.lag + 1) :]

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
        """|G|^2_ema > 0, and also trSigma_ema >= 0 up to round-off: a negative noise estimate would give a
        negative B_simple, which is shown as NaN too rather than as a number."""
        return self.t > 0 and self.grad_sq_norm > 0 and self._trace_sigma_or_zero() >= 0

    @property
    def b_simple(self) -> float:
        return self._trace_sigma_or_zero() / self.grad_sq_norm if self.valid else float("nan")

    @property
    def n_eff(self) -> float:
        return float(self.t) if self.window else ema_n_eff(self.beta, self.t)

    @property
    def warmup(self) -> int:
        """Updates before the band is shown: 3/(1-beta), when the EMA's second moments have settled."""
        if self.window:
            return 2
        return math.ceil(3 / (1 - self.beta)) if self.beta < 1 else 10**9

    @property
    def lag(self) -> int:
        """One EMA window, (1+beta)/(1-beta) updates (a whole window in window-sum mode). The trust gate reads
        the band's boundedness this many updates back: the EMA now holds a fraction 1 - beta^lag (87% at beta
        0.95) of fresh steps, so the gate is nearly independent of the errors of the band it lets through."""
        if self.window:
            return self.window
        return math.ceil((1 + self.beta) / (1 - self.beta)) if self.beta < 1 else 10**9

    def _moments(self) -> tuple[float, float, float, float, float]:
        """EMA means of trSigma and |G|^2 and the (co)variances of those means: the weighted per-step
        (co)variance, Bessel-corrected for EMA weights (x N_eff/(N_eff-1)), over N_eff."""
        tr, g2, n = self.trace_sigma, self.grad_sq_norm, self.n_eff
        v_tr = max(self._bc(self.m_tr2) - tr * tr, 0.0) / (n - 1)
        v_g2 = max(self._bc(self.m_g22) - g2 * g2, 0.0) / (n - 1)
        return tr, g2, v_tr, v_g2, (self._bc(self.m_trg2) - tr * g2) / (n - 1)

    def _band(self) -> tuple[float, float]:
        if self.t < 2 or self.n_eff <= 1:
            return math.nan, math.nan
        return fieller_band(*self._moments())

    @property
    def band(self) -> tuple[float, float]:
        """(lo, hi) of B_simple at +-Z_BAND SE (Fieller; hi = inf while |G|^2 is not significantly > 0);
        NaN during the warm-up."""
        return self._band() if self.t >= self.warmup else (math.nan, math.nan)

    @property
    def trusted(self) -> bool:
        """The recommendation's gate: past the warm-up, and the band was bounded one EMA window (`lag`
        updates) ago. Testing the current band instead opens the gate exactly when |G|^2 happens to be
        overestimated, and then the band misses the truth (docs/probes.md 1.6)."""
        return self.t >= self.warmup and len(self.bounded) > self.lag and self.bounded[0]

    @property
    def b_simple_rel_se(self) -> float:
        """Delta-method relative SE of B_simple from the per-step variances and covariance (docs/probes.md
        1.4); only a size indicator: the band and the gate use Fieller's set, which does not divide by
        the noisy |G|^2."""
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
    """Goodput-optimal batch on fixed hardware (docs/probes.md 1.6): with step time t_f + t_u B, progress per
    second ~ B / ((B + B_simple)(t_f + t_u B)) peaks at B* = sqrt(B_simple t_f / t_u). NaN if an input is
    unknown; monotone in B_simple, so it maps the B_simple band to a B* band (b_star(0) = 0, b_star(inf) = inf)."""
    if not (b_simple >= 0 and t_fixed > 0 and t_per_unit > 0):
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
    target_band: tuple[float, float] | None = None,
) -> Recommendation:
    """The point of the target band (default kappa x the B_simple band; pass the B* band for the
    goodput-optimal variant) nearest the current batch, so the advice moves the batch only when the current
    one lies outside the band; then clipped to [b_min, b_max], within x2 / /2 of the current batch and
    rounded to a multiple of `multiple`. NaN unless `state.trusted`. Recommend only."""
    if not state.trusted:
        return Recommendation(float("nan"), f"not trusted yet (update {state.t}; see docs/probes.md 1.6)")
    lo, hi = (kappa * state.band[0], kappa * state.band[1]) if target_band is None else target_band
    if not lo <= hi:
        return Recommendation(float("nan"), "no target")
    want = min(max(float(current), lo), hi)
    clipped = min(max(want, b_min, current / 2), b_max, current * 2)
    rounded = max(multiple, round(clipped / multiple) * multiple)
    return Recommendation(float(rounded), "ok")


@dataclass
class Hysteresis:
    """Hold a recommendation for at least `hold` steps before it may change (docs/probes.md 1.6: at most every R
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

    def restart(self) -> None:
        """Every level's EMA from scratch (the skipped counts stay)."""
        self.levels = {k: GNSState(beta=self.beta, skipped=v.skipped) for k, v in self.levels.items()}
        self.last = {}

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


def level_report(
    st: GNSState, raw: RawEstimate | None, units: float, group_size: float, group_tokens: float, big_sq_norm: float
) -> dict[str, float]:
    """The probe/gns/* metrics of the primary level's state `st` and its last raw estimate, for a step of `units`
    units of `group_size` sequences, `group_tokens` tokens per group on average, whose full-batch gradient's
    squared norm was `big_sq_norm`."""
    bs, (lo, hi) = st.b_simple, st.band
    nan = float("nan")
    return {
        "probe/gns/b_simple": bs,
        "probe/gns/b_simple_seq": bs * group_size,
        "probe/gns/b_simple_tokens": bs * group_tokens,
        # Fieller band at +-2 SE (docs/probes.md 1.6): NaN in the warm-up, hi = inf while |G|^2 is not
        # significantly above 0
        "probe/gns/b_simple_lo": lo,
        "probe/gns/b_simple_hi": hi,
        "probe/gns/trusted": float(st.trusted),  # the recommendation's gate
        "probe/gns/zone_lo": bs / 2,  # efficient zone B in [B_s/2, 2 B_s]
        "probe/gns/zone_hi": bs * 2,
        "probe/gns/grad_sq_norm_est": st.grad_sq_norm,
        "probe/gns/trace_sigma_est": st.trace_sigma,
        "probe/gns/grad_sq_norm_raw": raw.grad_sq_norm if raw else nan,
        "probe/gns/trace_sigma_raw": raw.trace_sigma if raw else nan,
        "probe/gns/small_sq_norm_mean": raw.s_bar if raw else nan,
        "probe/gns/big_sq_norm": big_sq_norm,
        "probe/gns/n_small": raw.k if raw else 0.0,
        "probe/gns/a": raw.a if raw else nan,
        "probe/gns/beta": raw.beta if raw else nan,
        "probe/gns/batch_units": units,
        "probe/gns/b_simple_rel_se": st.b_simple_rel_se,
        "probe/gns/n_eff": st.n_eff,
        "probe/gns/valid": float(st.valid),
        "probe/gns/skipped_steps": float(st.skipped),
        "probe/gns/batch_ratio": units / bs if st.valid and bs > 0 else nan,
        "probe/gns/step_efficiency": units / (units + bs) if st.valid else nan,
        "probe/gns/sample_efficiency": bs / (units + bs) if st.valid else nan,
    }
