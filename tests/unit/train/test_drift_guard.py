"""The length-drift guard (train/drift_guard.py): a scripted sequence of in-loop evals, the alert, the stop, resume."""

from __future__ import annotations

from rl_training.base.exit_codes import DRIFT_EXIT_CODE
from rl_training.config.schema import EvalCfg
from rl_training.runtime.cli import exit_status_of
from rl_training.train.drift_guard import ALERT, DriftGuard


def evals(guard: DriftGuard, points) -> list[dict]:
    return [guard.observe(step, {"eval/accuracy": a, "eval/truncation_rate": t}) for step, a, t in points]


def test_drift_needs_both_the_fall_and_the_rise_and_stops_after_the_streak():
    g = DriftGuard(EvalCfg())  # drop 0.1, rise 0.2, stop after 2
    assert g.observe(5, {"rollout/reward_mean": 0.3}) == {}  # a step without an eval
    out = evals(
        g,
        [
            (10, 0.50, 0.00),  # the first eval is the best so far
            (20, 0.60, 0.05),  # a new best; the truncation baseline stays the lowest rate, 0.00
            (30, 0.45, 0.10),  # accuracy fell 0.15, truncation rose only 0.10: noise, not drift
            (40, 0.58, 0.60),  # truncation rose 0.55, accuracy fell only 0.02: longer answers, still right
            (50, 0.49, 0.30),  # fell 0.11 >= 0.1 and rose 0.30 >= 0.2: drift 1
        ],
    )
    assert [o[ALERT] for o in out] == [0, 0, 0, 0, 1] and not g.tripped()
    assert evals(g, [(60, 0.55, 0.90)])[0] == {ALERT: 0.0, "eval/drift_streak": 0.0}  # 0.55 > 0.50: streak reset
    assert [o["eval/drift_streak"] for o in evals(g, [(70, 0.30, 0.90), (80, 0.10, 1.00)])] == [1, 2]
    assert g.tripped()
    err = g.error("checkpoint at step 80 saved")
    assert exit_status_of(lambda: (_ for _ in ()).throw(err)) == DRIFT_EXIT_CODE == 65
    msg = str(err)
    assert "step 70: accuracy 0.300, truncation 0.900; step 80: accuracy 0.100, truncation 1.000" in msg
    assert "the best eval, step 20: accuracy 0.600, truncation 0.050; the lowest truncation 0.000" in msg
    assert "\n" not in msg


def test_the_truncation_baseline_is_the_lowest_rate_not_the_best_evals():
    """SmolLM2 at lr 1e-3 (docs/real_model.md): the greedy answers ran into the token cap while accuracy first rose,
    so the best eval (step 20) was already 86% truncated. Measured from it, step 30's rise is 0.141 < 0.2 and the
    guard stayed silent; measured from the lowest rate (0.0 at step 10) it is 1.0, and accuracy fell 0.188 from
    the best: drift."""
    g = DriftGuard(EvalCfg())
    out = evals(g, [(10, 0.296875, 0.0), (20, 0.359375, 0.859375), (30, 0.171875, 1.0)])
    assert [o[ALERT] for o in out] == [0, 0, 1]
    assert g.low_trunc == 0.0 and g.best == (20, 0.359375, 0.859375)
    resumed = DriftGuard(EvalCfg(), g.state_dict())  # the baseline is checkpointed
    assert resumed.low_trunc == 0.0 and evals(resumed, [(40, 0.1, 1.0)])[0]["eval/drift_streak"] == 2
    old = DriftGuard(EvalCfg(), {"best": [20, 0.359375, 0.859375], "history": []})  # a checkpoint before the key
    assert old.low_trunc == 0.859375


def test_a_resumed_guard_continues_the_streak_and_zero_only_alerts():
    g = DriftGuard(EvalCfg())
    evals(g, [(10, 0.8, 0.0), (20, 0.5, 0.5)])
    resumed = DriftGuard(EvalCfg(), g.state_dict())
    assert evals(resumed, [(30, 0.4, 0.6)])[0]["eval/drift_streak"] == 2 and resumed.tripped()
    alert_only = DriftGuard(EvalCfg(drift_stop_evals=0))
    out = evals(alert_only, [(10, 0.8, 0.0), (20, 0.1, 1.0), (30, 0.0, 1.0), (40, 0.0, 1.0)])
    assert [o[ALERT] for o in out] == [0, 1, 1, 1] and not alert_only.tripped()
