"""A two-rank run whose work is done exits 0 on every rank. The abort this guards against (issue 30, item 3):
rank 1 died with SIGABRT, "terminate called without an active exception", about one full-suite run in three.
The process group outlived destroy_process_group (torch.distributed.nn.functional, imported after the group
existed, held it as default arguments), so gloo's worker threads lived into interpreter finalization; one of
them dropping its last finished collective then needed the GIL, and Python ended it with pthread_exit, which
aborts when it unwinds through a noexcept C++ destructor (rl_training/base/dist.py, cleanup()).

The first test checks the mechanism on every run (no gloo thread left after the runner's main); the stress tier
runs 20 small two-rank runs back to back under CPU load (tests/stress/test_exits.py; scripts/stress_exits.py is
the same loop as a script with a table).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TESTCFG, torchrun_cmd

sys.path.insert(0, str(REPO / "scripts"))
import stress_exits

SMALL = ["train.total_steps=1", "ckpt.every=0", "eval.every=0"]  # HF backend (testconfig), the tiny model
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's workers and its transport's event loop

# The runner's main, then one line naming the threads still alive in this process (Linux: /proc/self/task), in
# a file per rank beside this script (not the shared stderr pipe, where a line went missing once in a full run).
AFTER_MAIN = """
import os, sys
from rl_training.runners import rl_runner
status = rl_runner.main(sys.argv[1:])
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
with open(os.path.join(os.path.dirname(__file__), f"threads_rank{os.environ['RANK']}.txt"), "w") as f:
    f.write(f"threads after main, rank {os.environ['RANK']}: {' '.join(names)}")
sys.exit(status)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names from /proc (Linux)")
def test_no_gloo_thread_outlives_the_runner(run_overrides, tmp_path):
    script = tmp_path / "after_main.py"
    script.write_text(AFTER_MAIN)
    o = stress_exits.run_once(torchrun_cmd(2, script, "--cfg", TESTCFG, *run_overrides, *SMALL), tmp_path)
    assert (o.launcher_status, o.statuses) == (0, [0, 0]), o.stderr[-3000:]
    lines = [p.read_text() for p in sorted(tmp_path.glob("threads_rank*.txt"))]
    assert [x.split(":")[0] for x in lines] == ["threads after main, rank 0", "threads after main, rank 1"], o.stderr
    for line in lines:
        assert not any(name in line for name in GLOO_THREADS), line
    assert "outlived destroy_process_group" not in o.stderr


def test_rank_statuses_read_from_torchrun_report():
    report = """Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3570)  (SIGTERM)
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 3571)  (SIGABRT)
"""
    assert stress_exits.rank_statuses(1, report, 2) == [-15, -6]
    assert stress_exits.rank_statuses(0, "", 2) == [0, 0]
    assert stress_exits.rank_statuses(1, report.split("Root Cause")[1], 2) == [0, -6]  # a rank not listed: 0
