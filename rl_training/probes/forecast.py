"""A forecast of the run's final held-out reward from its first evaluations (issue 52, item 4; docs/probes.md 11).

ScaleRL (arXiv 2510.13786) fits held-out reward against training compute C with a saturating curve early in a run:

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

A is the asymptote, B the efficiency exponent, C_mid the compute at half the gain. Here C is the completions the
run has generated (the cost a researcher chooses to spend), and the curve is evaluated at the run's planned total.

The fit: for fixed (B, C_mid) the curve is linear in (R0, A), so those two are least squares and (B, C_mid) a grid
(log-spaced; C_mid up to 10x the planned total, where the curve is still rising at the end). The band: a residual
bootstrap, the fit repeated on the fitted curve plus the residuals resampled with replacement, its quantiles at the
planned total. A generator seeded with 0 makes the band a function of the data: the same run, the same band.
Pure numpy; total on any finite input (fewer than MIN_POINTS distinct points: no forecast).

Where the task declares its reward's range (`Task.reward_range`), the forecast, its band and the asymptote are
clipped to it. For a final reward inside the range that never moves a forecast further from it, and a band covers
it whenever the unclipped band did (clipping is monotone). Fitting inside the range instead (R0 and A held in
the box) was tried and is worse: on the recorded run that finds the reversal late, the step-50 forecast fell from
0.920 to 0.826 against a final 0.947, its band no longer covering the final (docs/probes.md 11).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_POINTS = 4  # four parameters
EXPONENTS = np.geomspace(0.25, 4.0, 25)


@dataclass(frozen=True)
class Forecast:
    final: float  # predicted held-out reward at the planned total
    lo: float  # the band's ends (bootstrap quantiles)
    hi: float
    asymptote: float  # A
    start: float  # R0
    c_mid: float
    exponent: float  # B
    points: int  # evaluations fitted


def _shape(c: np.ndarray, c_mid: np.ndarray, b: np.ndarray) -> np.ndarray:
    """s = 1 / (1 + (C_mid / C)^B) for every grid point: [grid, points]."""
    return 1.0 / (1.0 + np.exp(b[:, None] * (np.log(c_mid)[:, None] - np.log(c)[None, :])))


def _grid(c: np.ndarray, c_final: float) -> tuple[np.ndarray, np.ndarray]:
    mids = np.geomspace(max(c.min() / 10, 1e-9), 10 * max(c_final, c.max()), 40)
    m, b = np.meshgrid(mids, EXPONENTS, indexing="ij")
    return m.ravel(), b.ravel()


def _fit(s: np.ndarray, y: np.ndarray) -> tuple[int, float, float]:
    """The grid point whose least-squares (R0, A) fits y best: (index, R0, A). y [points] or [boots, points]."""
    ys = np.atleast_2d(y)
    # R = R0 (1 - s) + A s: the 2x2 normal equations per grid point
    u, v = 1.0 - s, s
    uu, uv, vv = (u * u).sum(1), (u * v).sum(1), (v * v).sum(1)
    det = uu * vv - uv * uv
    ok = det > 1e-12 * (uu * vv + 1e-30)
    uy, vy = ys @ u.T, ys @ v.T  # [boots, grid]
    r0 = np.where(ok, (vv * uy - uv * vy) / np.where(ok, det, 1.0), np.nan)
    a = np.where(ok, (uu * vy - uv * uy) / np.where(ok, det, 1.0), np.nan)
    yy = (ys * ys).sum(1)[:, None]
    sse = r0 * r0 * uu + a * a * vv + 2 * r0 * a * uv - 2 * r0 * uy - 2 * a * vy + yy  # sum (R0 u + A v - y)^2
    sse = np.where(ok, sse, np.inf)
    best = np.argmin(sse, axis=1)
    rows = np.arange(ys.shape[0])
    return best, r0[rows, best], a[rows, best]


def forecast(
    completions: Sequence[float],
    rewards: Sequence[float],
    c_final: float,
    band: float = 0.8,
    boots: int = 200,
    bounds: tuple[float, float] | None = None,
) -> Forecast | None:
    """The saturating curve through (completions generated, held-out reward) and its value at `c_final`, with the
    central `band` of the bootstrap; None with fewer than MIN_POINTS finite points at distinct positive C. With
    `bounds` (the reward's range), the forecast, the band and the asymptote are clipped to it."""
    pts = sorted({(float(c), float(r)) for c, r in zip(completions, rewards, strict=True)})
    pts = [(c, r) for c, r in pts if c > 0 and math.isfinite(c) and math.isfinite(r)]
    if len({c for c, _ in pts}) < MIN_POINTS or not (c_final > 0 and math.isfinite(c_final)):
        return None
    c, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    mids, exps = _grid(c, c_final)
    s = _shape(c, mids, exps)
    s_final = _shape(np.array([c_final]), mids, exps)[:, 0]
    (i,), (r0,), (a,) = _fit(s, y)
    fitted = r0 * (1 - s[i]) + a * s[i]
    final = r0 + (a - r0) * s_final[i]
    resid = y - fitted
    gen = np.random.default_rng(0)
    ys = fitted[None] + resid[gen.integers(0, len(y), size=(boots, len(y)))]
    bi, br0, ba = _fit(s, ys)
    finals = br0 + (ba - br0) * s_final[bi]
    lo, hi = np.quantile(finals, [(1 - band) / 2, (1 + band) / 2])
    lo, hi = min(lo, final), max(hi, final)
    if bounds is not None:
        final, lo, hi, a = np.clip([final, lo, hi, a], *bounds)
    return Forecast(float(final), float(lo), float(hi), float(a), float(r0),
                    float(mids[i]), float(exps[i]), len(y))  # fmt: skip


FINAL, LO, HI = "probe/forecast/final_reward", "probe/forecast/final_reward_lo", "probe/forecast/final_reward_hi"


class RunForecast:
    """The runner's forecast: every step adds its completions generated (rollout/completions_generated, or the
    step's B x K), every in-loop eval its eval/reward_mean; from step `start` on, an eval step also logs the
    forecast at the planned total (this run's completions per step so far, times its total steps). Its state
    (the evaluations and the completions so far) is checkpointed, so a resumed run forecasts as the whole would.
    `bounds`: the task's reward range (Task.reward_range), None where the task declares none."""

    def __init__(
        self,
        start: int,
        total_steps: int,
        per_step: int,
        state: dict | None = None,
        bounds: tuple[float, float] | None = None,
    ):
        self.start, self.total, self.per_step, self.bounds = start, total_steps, per_step, bounds
        state = state or {}
        self.spent: float = float(state.get("spent", 0.0))
        self.points: list[tuple[float, float]] = [tuple(p) for p in state.get("points", [])]

    @classmethod
    def from_config(cls, cfg, state: dict | None, bounds: tuple[float, float] | None = None) -> RunForecast:
        """From probe.forecast_from (off without in-loop evals), the planned steps and the configured split."""
        r = cfg.rollout
        start = cfg.probe.forecast_from if cfg.eval.every else 0
        return cls(start, cfg.train.total_steps, r.prompts_per_step * r.group_size, state, bounds)

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """`step`: completed steps; the forecast's metrics when it is due, else {}."""
        self.spent += float(metrics.get("rollout/completions_generated", self.per_step))
        if not self.start or "eval/reward_mean" not in metrics:
            return {}
        self.points.append((self.spent, float(metrics["eval/reward_mean"])))
        if step < self.start:
            return {}
        f = forecast(*zip(*self.points, strict=True), c_final=self.spent / step * self.total, bounds=self.bounds)
        if f is None:
            return {}
        return {FINAL: f.final, LO: f.lo, HI: f.hi, "probe/forecast/asymptote": f.asymptote}

    def state_dict(self) -> dict:
        return {"spent": self.spent, "points": [list(p) for p in self.points]}
