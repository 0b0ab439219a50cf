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


FAKE_CUDA = """
import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as set_cpu_threads sees it
torch.cuda.device_count = lambda: 1
torch.set_num_threads(4)  # torch's default there: a thread per machine core
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_threads_are_set_on_a_cuda_machine_too():
    """Issue 41, item 4: with CUDA available set_cpu_threads did nothing, so RL_CPU_THREADS and the rank's share
    were ignored and a GH200 rank kept a thread per machine core."""
    code = FAKE_CUDA + CODE
    env = {"RL_NUMA_BIND": "0"}  # no sysfs lookup of the fake GPU
    r = subprocess.run(
        [sys.executable, "-c", code, "1"],
        env={**os.environ, "PYTHONPATH": str(REPO), "LOCAL_WORLD_SIZE": "1", **env, "RL_CPU_THREADS": "3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.split()[-1:] == ["3"], r.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "RL_CPU_THREADS"}
    r = subprocess.run(
        [sys.executable, "-c", code, "1"],
        env={**env, "PYTHONPATH": str(REPO), "LOCAL_WORLD_SIZE": "1", "RL_NUMA_BIND": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.split()[-1:] == ["1"], r.stderr[-2000:]  # one allowed core: one thread, not 4


def test_thread_count_from_the_affinity_after_the_numa_binding():
    from rl_training.runtime.seeding import thread_count

    nodes = [set(range(72 * k, 72 * (k + 1))) for k in range(4)]  # GH200 node: a Grace of 72 CPUs per GPU
    assert thread_count(nodes[1], 4, nodes) == 72  # bound to its own Grace: all of it (was 288, torch's default)
    # 2 sockets of 56 CPUs, 8 GPUs, 4 per socket: the 4 ranks of a socket share its CPUs
    sockets = [set(range(56)), set(range(56, 112))]
    assert thread_count(sockets[0], 8, [sockets[i // 4] for i in range(8)]) == 14
    assert thread_count(set(range(288)), 4, []) == 72  # no binding (CPU, RL_NUMA_BIND=0): every rank shares
    assert thread_count(set(range(288)), 4, [set(), set(), set(), set()]) == 72  # numa_node -1: the same
    assert thread_count({3}, 8, []) == 1  # never 0


def test_gpu_cpus_of_the_local_ranks_from_sysfs(tmp_path, monkeypatch):
    import torch

    from rl_training.base import dist
    from rl_training.runtime import seeding

    for i, (node, cpus) in enumerate([(0, "0-71"), (1, "72-143")]):
        dev = tmp_path / "bus" / "pci" / "devices" / f"0009:0{i}:00.0"
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
        (tmp_path / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "gpu_pci_address", lambda i: f"0009:0{i}:00.0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RL_DEVICE", raising=False)
    monkeypatch.delenv("RL_NUMA_BIND", raising=False)
    assert seeding.local_gpu_cpus(2, tmp_path) == [set(range(72)), set(range(72, 144))]
    monkeypatch.setenv("RL_NUMA_BIND", "0")
    assert seeding.local_gpu_cpus(2, tmp_path) == []
    monkeypatch.setenv("RL_NUMA_BIND", "1")
    monkeypatch.setenv("RL_DEVICE", "cpu")  # a rank kept on the CPU is not bound
    assert seeding.local_gpu_cpus(2, tmp_path) == []
