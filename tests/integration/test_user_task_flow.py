"""A user's task taken end to end the way a new user would (issue 39, item 8): synthesize from the user's own
directory prints an SFT command that runs there as printed, with the task's arguments, and SFT trains on the rows
synthesize wrote although the task's `parse` reads other records; evals.run reports the grader's errors and
time-outs beside accuracy; a bad task spec under torchrun is one line, not one per rank."""

from __future__ import annotations

import subprocess

from tests.helpers import RL_RUNNER, TESTCFG, torchrun_cmd


def test_bad_task_spec_under_torchrun_prints_one_line(run_overrides, tmp_path):
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *run_overrides, "task.name=nonexistent.py:X")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode != 0
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:") and "nonexistent.py" in x]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-4000:]
    assert "exitcode  : 2" in r.stderr  # every rank exits with the one-line error's status
