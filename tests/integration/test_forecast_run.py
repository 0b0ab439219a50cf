"""The run forecast on the real runner (probes/forecast.py RunForecast, issue 52 item 4): with scripted in-loop
evals (the eval's numbers replaced, the training real), each eval from probe.forecast_from on logs the forecast of
the points so far at the planned total, clipped to the task's reward range, and a run crashed and resumed logs the
same forecasts as the uninterrupted one (the evaluations and the completions so far are checkpointed)."""

from __future__ import annotations

import pytest

from rl_training.probes.forecast import FINAL, HI, LO, forecast
from rl_training.runners import rl_runner
from rl_training.tasks.reverse import ReverseTask
from tests.helpers import TESTCFG, Crash, crash_at, read_metrics

pytestmark = pytest.mark.slow

PER_STEP = 16  # cfg/testconfig.yaml: 4 prompts x 4 completions
# held-out reward after step s: a saturating climb with a +-0.02 wobble, so the bootstrap band has a width
REWARD = {s: 0.2 + 0.6 / (1 + (40 / (PER_STEP * s)) ** 1.5) + (0.02 if s % 2 else -0.02) for s in range(1, 9)}


@pytest.fixture
def scripted_evals(monkeypatch):
    monkeypatch.setattr(rl_runner, "maybe_eval", lambda run, step: {"eval/reward_mean": REWARD[step]})


def test_forecasts_from_the_scripted_evals_and_a_resume_logs_the_same(
    run_overrides, tmp_path, scripted_evals, monkeypatch
):
    # The task's range, narrowed to 0.75 so that it bites: unclipped, step 5's band reaches 0.837 and its
    # asymptote 0.793 (step 7's 0.801); the forecasts themselves (0.67-0.73) and step 8's band (0.681-0.717) stay.
    monkeypatch.setattr(ReverseTask, "reward_range", (0.0, 0.75))
    base = [*run_overrides, "train.total_steps=8", "eval.every=1", "probe.forecast_from=5", "ckpt.every=3"]
    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=straight"]) == 0
    straight = read_metrics(tmp_path / "runs" / "straight")
    assert [FINAL in m for m in straight] == [False] * 4 + [True] * 4  # from step 5, with 5 evals
    for m in straight[4:]:
        s = m["step"]
        c, r = [PER_STEP * t for t in range(1, s + 1)], [REWARD[t] for t in range(1, s + 1)]
        want = forecast(c, r, PER_STEP * 8, bounds=(0.0, 0.75))
        assert (m[FINAL], m[LO], m[HI]) == pytest.approx((want.final, want.lo, want.hi), abs=1e-12)
        assert m["probe/forecast/asymptote"] == pytest.approx(want.asymptote, abs=1e-12)
    assert straight[4][HI] == 0.75 and forecast(c[:5], r[:5], PER_STEP * 8).hi > 0.8  # clipped
    assert straight[-1][HI] > straight[-1][LO]

    real_step = rl_runner.rl_step
    crash_at(monkeypatch, 4)  # 0-based: steps 1-4 logged, the checkpoint at 3 exists
    with pytest.raises(Crash):
        rl_runner.main(["--cfg", TESTCFG, *base, "run.name=crashed"])
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=crashed", "ckpt.resume=latest"]) == 0
    resumed = read_metrics(tmp_path / "runs" / "crashed")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for a, b in zip(straight, resumed, strict=True):
        assert {k: v for k, v in a.items() if k.startswith("probe/forecast/")} == {
            k: v for k, v in b.items() if k.startswith("probe/forecast/")
        }
