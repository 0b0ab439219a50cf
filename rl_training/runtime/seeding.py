"""Seeding and CPU threads, set once per process by the runners, evals and benchmarks."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from rl_training.base.errors import UserError


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_cpu_threads() -> None:
    """Split the cores this process may run on between the ranks of this node (torchrun sets LOCAL_WORLD_SIZE).
    The affinity mask, not os.cpu_count(): under a SLURM cpuset, `taskset` or a container's cpus it is smaller
    than the machine, and a thread per machine core would oversubscribe the allowed ones.

    RL_CPU_THREADS, where set, is the count instead: for a machine shared with other work, where a second thread
    spins at every op's barrier while the other work holds its core (scripts/run_tests.sh runs two lanes so)."""
    if not torch.cuda.is_available():
        fixed = os.environ.get("RL_CPU_THREADS", "")
        if fixed:
            if not fixed.isdigit() or int(fixed) < 1:
                raise UserError(f"RL_CPU_THREADS={fixed!r}: a whole number of threads, at least 1")
            torch.set_num_threads(int(fixed))
            return
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, usable_cpus() // local))


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
