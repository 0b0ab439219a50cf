"""Seeding and CPU threads, set once per process by the runners, evals and benchmarks."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from rl_training.base import dist
from rl_training.base.errors import UserError


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_cpu_threads() -> None:
    """Split the cores this process may run on between the ranks of this node that share them (torchrun sets
    LOCAL_WORLD_SIZE), on the CPU and on CUDA alike: a rank that kept torch's default (a thread per machine core)
    would run 288 OpenMP threads on the 72 CPUs a GH200 rank is bound to. Called after init_distributed, so the
    affinity mask is the one after the NUMA binding (base/dist.py). The mask, not os.cpu_count(): under a SLURM
    cpuset, `taskset` or a container's cpus it is smaller than the machine.

    RL_CPU_THREADS, where set, is the count instead: for a machine shared with other work, where a second thread
    spins at every op's barrier while the other work holds its core (scripts/run_tests.sh runs two lanes so)."""
    fixed = os.environ.get("RL_CPU_THREADS", "")
    if fixed:
        if not fixed.isdigit() or int(fixed) < 1:
            raise UserError(f"RL_CPU_THREADS={fixed!r}: a whole number of threads, at least 1")
        torch.set_num_threads(int(fixed))
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(thread_count(allowed_cpus(), local_world, local_gpu_cpus(local_world)))


def thread_count(allowed: set[int], local_world: int, gpu_cpus: list[set[int]]) -> int:
    """Threads for a rank allowed `allowed` CPUs. `gpu_cpus`: the NUMA-node CPUs of each local rank's GPU (empty
    on the CPU, or without the binding): a rank shares its CPUs with the ranks whose node overlaps them (on a
    GH200 node none, on a 2-socket 8-GPU box the 4 of its socket); without that knowledge, with every rank of
    the node."""
    sharing = sum(1 for cpus in gpu_cpus if cpus & allowed) or local_world
    return max(1, len(allowed) // sharing)


def local_gpu_cpus(local_world: int, sysfs: Path = Path("/sys")) -> list[set[int]]:
    """The NUMA-node CPUs of local ranks 0..local_world-1's GPUs (rank i on cuda:i, as init_distributed places
    them) when this process runs on CUDA with the NUMA binding on; else []."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if os.environ.get("RL_NUMA_BIND", "1") == "0" or not dist.use_cuda(local_rank):
        return []
    n = min(local_world, torch.cuda.device_count())
    return [dist.numa_node_cpus(dist.gpu_pci_address(i), sysfs) for i in range(n)]


def allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):  # Linux
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))
