"""set_cpu_threads counts the cores the process may run on (its affinity mask: taskset, a SLURM cpuset), not
the machine's: two threads on one allowed core only contend.

In a fresh interpreter: an in-process vLLM engine built earlier in the session replaces torch.set_num_threads
with a no-op ("CPU backend doesn't allow to use torch.set_num_threads after the thread binding"), so the check
cannot run inside the pytest process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

CODE = """
import os, sys, torch
from rl_training.runtime.seeding import set_cpu_threads
allowed = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, set(allowed[: int(sys.argv[1])]))
set_cpu_threads()
print(torch.get_num_threads())
"""


def threads(cores: int, local_world: int, extra: dict | None = None) -> int | str:
    """torch's thread count after set_cpu_threads with `cores` allowed cores and `local_world` ranks, or its error."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOCAL_WORLD_SIZE": str(local_world), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RL_CPU_THREADS", None)  # make test sets it (scripts/run_tests.sh)
    env.update(extra or {})
    r = subprocess.run([sys.executable, "-c", CODE, str(cores)], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode:
        return r.stderr.strip().splitlines()[-1]
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_threads_follow_the_affinity_mask():
    allowed = len(os.sched_getaffinity(0))
    assert threads(1, 1) == 1  # one allowed core, whatever os.cpu_count() says
    assert threads(allowed, 1) == allowed  # all allowed cores, one rank
    assert threads(allowed, 2 * allowed) == 1  # more ranks than cores: never 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_rl_cpu_threads_is_the_count_where_set():
    allowed = len(os.sched_getaffinity(0))
    assert threads(allowed, 1, {"RL_CPU_THREADS": "1"}) == 1  # instead of every allowed core
    assert threads(1, 1, {"RL_CPU_THREADS": "3"}) == 3  # the count asked for, whatever the mask
    bad = threads(allowed, 1, {"RL_CPU_THREADS": "0"})
    assert bad == "rl_training.base.errors.UserError: RL_CPU_THREADS='0': a whole number of threads, at least 1"
