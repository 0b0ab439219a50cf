"""Progress without a terminal: whole lines at most every N seconds, with step, values and ETA."""

from __future__ import annotations

import io

from rl_training.metrics import progress
from rl_training.metrics.progress import LineProgress, NullProgress, make_progress


def test_lines_every_n_seconds_and_at_the_end(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    p = make_progress(total=10, initial=0, enabled=True, every_s=30.0, stream=out)
    assert isinstance(p, LineProgress)  # a StringIO is not a terminal
    for step in range(1, 11):
        clock[0] += 10.0  # 10 s per step: a line at steps 3, 6, 9 (30 s apart) and at the last step
        p.update(step, step_s=2.0 if step % 2 else 4.0, reward=step / 10)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 4
    # Step 3: median of step times [2, 4, 2] = 2 s, 7 steps left -> ETA 14 s.
    assert lines[0] == "[rl] step 3/10 (30%)  reward 0.3  step 2 s  ETA 0m14s"
    assert lines[-1].startswith("[rl] step 10/10 (100%)  reward 1") and lines[-1].endswith("ETA 0m00s")


def test_disabled_is_silent():
    assert isinstance(make_progress(5, 0, enabled=False, every_s=1.0), NullProgress)
