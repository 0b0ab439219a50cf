"""Twenty two-rank runs back to back under CPU load exit 0 on every rank (issue 30, item 3; the cause and the
fix: tests/integration/test_clean_exits.py). The load is two busy loops (`make test-stress`, about 4 minutes on
2 cores), or, with RL_STRESS_BURNERS=0, whatever runs beside it: `make test` runs this tier in its side lane
while the integration tier (torchrun worlds, vLLM engines, benchmarks) holds the cores, and CI relies on that."""

from __future__ import annotations

import os
import sys
import time

from tests.helpers import REPO, RL_RUNNER, TESTCFG, read_steps, torchrun_cmd

sys.path.insert(0, str(REPO / "scripts"))
import stress_exits

SMALL = ["train.total_steps=1", "ckpt.every=0", "eval.every=0"]  # HF backend (testconfig), the tiny model


def test_twenty_two_rank_runs_under_load_exit_clean(run_overrides, tmp_path):
    runs = 20
    outcomes = []
    t0 = time.perf_counter()
    burners = int(os.environ.get("RL_STRESS_BURNERS", "2"))  # 0: the suite running beside it is the load
    with stress_exits.burning(burners):  # both cores busy: rare teardown interleavings come up
        for i in range(runs):
            cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *run_overrides, *SMALL, f"run.name=r{i:02d}")
            outcomes.append(stress_exits.run_once(cmd, tmp_path))
    elapsed = time.perf_counter() - t0
    print(f"\n{runs} two-rank runs under load ({burners} busy loops) in {elapsed:.0f} s")
    print(stress_exits.summary(outcomes))
    bad = [o for o in outcomes if not o.clean]
    assert [o.launcher_status for o in outcomes] == [0] * runs, bad[0].stderr[-3000:]
    assert [o.statuses for o in outcomes] == [[0, 0]] * runs
    assert sum(o.terminated for o in outcomes) == 0
    assert sum(o.traceback for o in outcomes) == 0
    assert not any("outlived destroy_process_group" in o.stderr for o in outcomes)
    assert [read_steps(tmp_path / "runs" / f"r{i:02d}") for i in range(runs)] == [[1]] * runs  # each did its step
