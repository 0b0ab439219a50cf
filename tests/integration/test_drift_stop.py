"""The length-drift guard on the real runner (train/drift_guard.py): a scripted sequence of in-loop evals (the
eval's numbers replaced, the training real) stops the run after two drifting evals, checkpointed first, with exit
status 65 and one line; a resume continues the streak; eval.drift_stop_evals=0 only alerts."""

from __future__ import annotations

import pytest

from rl_training.base.exit_codes import DRIFT_EXIT_CODE
from rl_training.ckpt.store import list_checkpoints
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, read_metrics

pytestmark = pytest.mark.slow

# (accuracy, greedy truncation rate) of the in-loop eval after each step: the best at step 2; step 3 fell 0.2 while
# truncation rose 0.5 (drift 1), step 4 the same again (drift 2: the stop), step 5 would recover
EVALS = {1: (0.5, 0.0), 2: (0.6, 0.0), 3: (0.4, 0.5), 4: (0.3, 0.9), 5: (0.7, 0.0), 6: (0.7, 0.0)}


@pytest.fixture
def scripted_evals(monkeypatch):
    def evals(run, step):
        acc, trunc = EVALS[step]
        return {"eval/accuracy": acc, "eval/truncation_rate": trunc}

    monkeypatch.setattr(rl_runner, "maybe_eval", evals)


def test_two_drifting_evals_stop_the_run_checkpointed_and_a_resume_keeps_the_streak(
    run_overrides, tmp_path, scripted_evals, capsys
):
    args = ["--cfg", TESTCFG, *run_overrides, "train.total_steps=6", "ckpt.every=0", "eval.every=1"]
    assert rl_runner.main(args) == DRIFT_EXIT_CODE
    run_dir = tmp_path / "runs" / "testconfig"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["eval/alert/length_drift"] for m in metrics] == [0, 0, 1, 1]
    # step 4: the stop's checkpoint; step 2: ckpt.keep_best's (auto: the best eval/accuracy), the one to go back to
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4]
    err = capsys.readouterr()
    (line,) = [x for x in err.err.splitlines() if x.startswith("error:")]
    assert "length drift" in line and "step 3: accuracy 0.400, truncation 0.500; step 4: accuracy 0.300" in line
    assert "checkpoint at step 4 saved" in line
    assert "probe alert eval/alert/length_drift=1" in err.out  # the alert, printed when it switches on
    # Resumed from step 4: the streak is 2, so step 5's recovery resets it and the run finishes
    assert rl_runner.main([*args, "ckpt.resume=latest"]) == 0
    assert [m["eval/drift_streak"] for m in read_metrics(run_dir)] == [0, 0, 1, 2, 0, 0]


def test_zero_only_alerts(run_overrides, tmp_path, scripted_evals):
    args = ["--cfg", TESTCFG, *run_overrides, "train.total_steps=6", "ckpt.every=0", "eval.every=1"]
    assert rl_runner.main([*args, "eval.drift_stop_evals=0"]) == 0
    metrics = read_metrics(tmp_path / "runs" / "testconfig")
    assert [m["eval/alert/length_drift"] for m in metrics] == [0, 0, 1, 1, 0, 0]
