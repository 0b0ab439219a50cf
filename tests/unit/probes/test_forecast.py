"""The run forecast (probes/forecast.py, issue 52 item 4): exact on a curve of its own family, invariant to the
units of compute and of reward, total on bad input, and tested on recorded runs (test_forecast_recorded)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_training.probes.forecast import EXPONENTS, MIN_POINTS, _grid, forecast


def curve(c, r0: float, a: float, c_mid: float, b: float):
    return r0 + (a - r0) / (1 + (c_mid / np.asarray(c, dtype=float)) ** b)


C = np.arange(1, 21) * 1280.0  # 20 evaluations, every 10 steps of 128 completions
FINAL = C[-1]


def test_a_curve_of_its_own_family_is_recovered_exactly():
    # Parameters on the fit's grid (a grid C_mid for the first 6 points and this final, the 10th exponent): the
    # least squares in (R0, A) are exact there, the sum of squares 0, so the forecast is the curve's value at the
    # planned total, and the bootstrap, resampling zero residuals, collapses the band onto it.
    mids, exps = _grid(C[:6], FINAL)  # (C_mid, exponent) pairs, C_mid-major
    j = 20 * len(EXPONENTS) + 9  # the 21st C_mid of 40 with the 10th exponent
    c_mid, b = mids[j], exps[j]
    assert b == EXPONENTS[9] and C[0] < c_mid < FINAL
    r = curve(C, 0.2, 0.9, c_mid, b)
    f = forecast(C[:6], r[:6], FINAL)
    truth = curve(FINAL, 0.2, 0.9, c_mid, b)
    assert f.final == pytest.approx(truth, abs=1e-9) and f.lo == pytest.approx(truth, abs=1e-9) == f.hi
    assert (f.start, f.asymptote, f.c_mid, f.exponent, f.points) == (
        pytest.approx(0.2),
        pytest.approx(0.9),
        c_mid,
        b,
        6,
    )


def test_the_units_of_compute_and_reward_do_not_matter():
    # Completions or tokens (C x 37): the grid scales with C, the fit does not move. A reward in other units
    # (2R + 1): the least squares are affine-equivariant and the bootstrap draws the same indices.
    r = curve(C, 0.3, 0.8, 6000.0, 1.5) + np.array([0.02, -0.01, 0.0, 0.015, -0.02] * 4)
    base = forecast(C[:8], r[:8], FINAL)
    scaled = forecast(C[:8] * 37, r[:8], FINAL * 37)
    shifted = forecast(C[:8], 2 * r[:8] + 1, FINAL)
    assert base.lo < base.final < base.hi  # noisy points: a band of some width
    assert (scaled.final, scaled.lo, scaled.hi) == pytest.approx((base.final, base.lo, base.hi), abs=1e-9)
    assert scaled.c_mid == pytest.approx(base.c_mid * 37)
    got = (shifted.final, shifted.lo, shifted.hi)
    assert got == pytest.approx((2 * base.final + 1, 2 * base.lo + 1, 2 * base.hi + 1), abs=1e-9)


def test_more_points_narrow_the_band_on_a_noisy_curve():
    r = curve(C, 0.3, 0.8, 6000.0, 1.5) + np.array([0.02, -0.02] * 10)
    early, late = forecast(C[:6], r[:6], FINAL), forecast(C, r, FINAL)
    assert late.hi - late.lo < early.hi - early.lo
    assert abs(late.final - curve(FINAL, 0.3, 0.8, 6000.0, 1.5)) < 0.02 + 1e-9  # within the noise's amplitude


def test_too_little_or_bad_input_gives_no_forecast():
    r = curve(C, 0.3, 0.8, 6000.0, 1.5)
    assert forecast(C[: MIN_POINTS - 1], r[: MIN_POINTS - 1], FINAL) is None
    assert forecast([C[0]] * 6, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], FINAL) is None  # one C: no curve
    assert forecast(C[:5], r[:5], 0.0) is None and forecast(C[:5], r[:5], math.inf) is None
    bad = [*r[:5], math.nan]
    assert forecast(C[:6], bad, FINAL) == forecast(C[:5], r[:5], FINAL)  # a non-finite reward is left out
    assert forecast([0.0, *C[:5]], [0.1, *r[:5]], FINAL) == forecast(C[:5], r[:5], FINAL)  # C = 0 is not on the curve
    flat = forecast(C[:6], [0.5] * 6, FINAL)
    assert flat.final == pytest.approx(0.5) and flat.lo == pytest.approx(0.5) == flat.hi


def test_on_recorded_runs_the_step_50_forecast_beats_the_reward_at_step_50():
    # Three recorded reverse-demo runs (tests/fixtures/forecast_runs.json, docs/probes.md 11): one finds the whole
    # reversal late (order 0: 0.695 at step 50, 0.947 at 200), one plateaus (order 100), one climbs slowly (300).
    # From the evals up to step 50, the forecast of the step-200 eval is closer than the step-50 eval itself
    # (persistence) on every run; the errors were -0.027, +0.010, -0.041 against -0.252, -0.021, -0.054.
    import json

    from tests.helpers import REPO

    recorded = json.loads((REPO / "tests" / "fixtures" / "forecast_runs.json").read_text())
    per_step, total = recorded["completions_per_step"], recorded["total_steps"]
    errors = {}
    for name, run in recorded["runs"].items():
        assert run["steps"][-1] == total
        early = [(s * per_step, r) for s, r in zip(run["steps"], run["reward"], strict=True) if s <= 50]
        f = forecast(*zip(*early, strict=True), c_final=total * per_step)
        final = run["reward"][-1]
        errors[name] = (f.final - final, early[-1][1] - final)
        assert f.points == 5 and abs(f.final - final) < abs(early[-1][1] - final), (name, errors[name])
    assert sum(abs(e) for e, _ in errors.values()) / len(errors) < 0.05  # mean absolute error 0.026


def test_the_reward_range_clips_the_forecast_and_never_moves_it_away_from_a_final_inside_it():
    # Order 0's evaluations up to step 100 (tests/fixtures/forecast_runs.json) still climb nearly linearly: the free
    # curve's asymptote is 8.6 and its forecast of step 200 is 1.032, above the reward's maximum 1. Clipped to [0, 1]:
    # the forecast is 1.0 (error +0.053 against the final 0.947 instead of +0.085), the band's top 1.0, its bottom
    # (0.837, inside) unmoved. A range wider than everything changes nothing.
    import json

    from tests.helpers import REPO

    recorded = json.loads((REPO / "tests" / "fixtures" / "forecast_runs.json").read_text())
    per_step, total, run = recorded["completions_per_step"], recorded["total_steps"], recorded["runs"]["order 0"]
    pts = [(s * per_step, r) for s, r in zip(run["steps"], run["reward"], strict=True) if s <= 100]
    free = forecast(*zip(*pts, strict=True), c_final=total * per_step)
    clipped = forecast(*zip(*pts, strict=True), c_final=total * per_step, bounds=(0.0, 1.0))
    assert free.final > 1.0 and free.hi > 1.0 and free.asymptote > 1.0 and free.lo < 1.0
    assert (clipped.final, clipped.hi, clipped.asymptote) == (1.0, 1.0, 1.0)
    assert clipped.lo == free.lo and (clipped.start, clipped.c_mid, clipped.exponent) == (
        free.start,
        free.c_mid,
        free.exponent,
    )
    final = run["reward"][-1]
    assert abs(clipped.final - final) < abs(free.final - final)
    assert forecast(*zip(*pts, strict=True), c_final=total * per_step, bounds=(-10.0, 10.0)) == free


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-2.0, 3.0), min_size=MIN_POINTS, max_size=10), st.floats(0.0, 1.0))
def test_clipping_is_never_worse_for_a_final_inside_the_range_and_keeps_the_band_s_coverage(rewards, final):
    # Clipping to [lo, hi] is monotone and fixes every point of the range: for y inside it, |clip(f) - y| <= |f - y|;
    # y in [a, b] implies y in [clip(a), clip(b)], and strictly inside the range the converse holds too (at a bound
    # a band wholly outside collapses onto it: rewards 1, 0, 0, 0 give a free band below 0 and a clipped one at 0).
    c = C[: len(rewards)]
    free, clipped = forecast(c, rewards, FINAL), forecast(c, rewards, FINAL, bounds=(0.0, 1.0))
    assert 0.0 <= clipped.lo <= clipped.final <= clipped.hi <= 1.0
    assert abs(clipped.final - final) <= abs(free.final - final) + 1e-12
    assert not (free.lo <= final <= free.hi) or (clipped.lo <= final <= clipped.hi)
    if 0.0 < final < 1.0:
        assert (free.lo <= final <= free.hi) == (clipped.lo <= final <= clipped.hi)
