"""A torchrun worker for test_vllm_backend's final-barrier test: the RL runner with the vLLM backend, where
rank 0's final upload (syncer.finish) starts once rank 1's has ended (a marker file) and takes FINISH_S seconds.
Each rank writes when its upload ended and when rl() returned to $BARRIER_OUT/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rl_training.ckpt.upload import NullSyncer
from rl_training.runners import rl_runner

FINISH_S = 4.0
FINISHED_AT: list[float] = []


def slow_finish(self, run_dir) -> None:
    marker = Path(os.environ["BARRIER_OUT"]) / "rank1.finished"
    if os.environ["RANK"] == "0":
        deadline = time.monotonic() + 300
        while not marker.exists():  # rank 1 (no upload) is done with its own: it now waits at the barrier
            if time.monotonic() > deadline:
                raise TimeoutError("rank 1 did not reach its final upload within 300 s")
            time.sleep(0.05)
        time.sleep(FINISH_S)  # the slow upload itself
    FINISHED_AT.append(time.time())
    if os.environ["RANK"] == "1":
        marker.write_text("")


if __name__ == "__main__":
    NullSyncer.finish = slow_finish
    status = rl_runner.main(sys.argv[1:])
    left = time.time()
    out = Path(os.environ["BARRIER_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps({"left": left, "finished_at": FINISHED_AT[0], "status": status}))
    sys.exit(status)
