"""set_cpu_threads counts the cores the process may run on (its affinity mask: taskset, a SLURM cpuset), not
the machine's: two threads on one allowed core only contend."""

from __future__ import annotations

import os

import pytest
import torch

from rl_training.assembly import set_cpu_threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_threads_follow_the_affinity_mask(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("set_cpu_threads only acts on CPU runs")
    mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
    one = min(mask)
    try:
        os.sched_setaffinity(0, {one})
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        set_cpu_threads()
        assert torch.get_num_threads() == 1  # one allowed core, whatever os.cpu_count() says
        os.sched_setaffinity(0, mask)
        set_cpu_threads()
        assert torch.get_num_threads() == len(mask)  # all allowed cores, one rank
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * len(mask)))
        set_cpu_threads()
        assert torch.get_num_threads() == 1  # more ranks than cores: never 0
    finally:
        os.sched_setaffinity(0, mask)
        torch.set_num_threads(threads)
