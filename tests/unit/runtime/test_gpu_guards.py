"""CPU guards for what only a GPU run would show (issue 12): NUMA binding from a fake sysfs tree, the process
group's timeout from the config, per-step CUDA peak memory, the flash-attn refusal, the vLLM seed layout."""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.metrics import step as step_metrics
from rl_training.policy.models import ModelLoadError, check_attn_implementation
from rl_training.rollout.vllm_engine import SEED_BITS, completion_seeds
from tests.helpers import REPO, free_port


def fake_sysfs(root, pci: str, node: int | str, cpulist: str):
    dev = root / "bus" / "pci" / "devices" / pci
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    if cpulist:
        n = root / "devices" / "system" / "node" / f"node{node}"
        n.mkdir(parents=True)
        (n / "cpulist").write_text(cpulist + "\n")
    return root


def test_numa_node_cpus_from_sysfs(tmp_path):
    # A GH200 node with 4 superchips: GPU 0009:01:00.0 on Grace node 1, CPUs 72-143 (and a second range).
    sysfs = fake_sysfs(tmp_path / "a", "0009:01:00.0", 1, "72-143,300")
    assert dist.numa_node_cpus("0009:01:00.0", sysfs) == set(range(72, 144)) | {300}
    # numa_node -1 (one node, or firmware that does not say) and a missing device: nothing to bind to.
    assert dist.numa_node_cpus("0000:01:00.0", fake_sysfs(tmp_path / "b", "0000:01:00.0", -1, "")) == set()
    assert dist.numa_node_cpus("0000:02:00.0", sysfs) == set()


def test_bind_to_numa_node_pins_every_thread_within_the_allowed_cpus(tmp_path):
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    sysfs = fake_sysfs(tmp_path, "0009:01:00.0", 0, f"{first},100000")  # 100000: not allowed here
    try:
        assert dist.bind_to_numa_node("0009:01:00.0", sysfs) == {first}
        assert all(os.sched_getaffinity(int(t)) == {first} for t in os.listdir("/proc/self/task"))
        assert dist.bind_to_numa_node("0000:00:00.0", sysfs) == set()  # unknown device: unchanged
        assert os.sched_getaffinity(0) == {first}
    finally:
        for t in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(t), allowed)


def _timeout_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), RL_DEVICE="cpu")  # a CPU test, also on a 1-GPU machine
    dist.init_distributed(timeout_s=3.0)
    if rank == 1:  # never joins the barrier: it waits until rank 0's has given up (its file), then leaves
        deadline = time.monotonic() + 120
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    t0 = time.monotonic()
    try:
        torch.distributed.barrier()
        result = "returned"
    except RuntimeError as e:  # gloo's timeout
        result = f"raised after {time.monotonic() - t0:.1f}s: {str(e)[:80]}"
    with open(out, "w") as f:
        f.write(result)


def test_process_group_timeout_comes_from_the_config(tmp_path):
    # run.dist_timeout_s = 3: rank 0's barrier gives up after ~3 s instead of gloo's default 30 min.
    out = tmp_path / "rank0.txt"
    mp.spawn(_timeout_worker, args=(free_port(), str(out)), nprocs=2)
    text = out.read_text()
    assert text.startswith("raised after"), text
    assert 2.5 < float(text.split()[2].rstrip("s:")) < 10.0, text


def test_dist_timeout_must_outlast_the_final_upload_wait():
    with pytest.raises(ConfigError, match="run.dist_timeout_s=200 <= sync.final_timeout_s=300"):
        load_config(None, ["run.dist_timeout_s=200"])
    assert load_config(None, ["run.dist_timeout_s=200"], training=False).run.dist_timeout_s == 200


def test_peak_cuda_memory_is_reset_every_step(monkeypatch):
    # Read, then reset: each step logs its own peak (a fake CUDA counter; the real one is in make gpu-check).
    peak = {"v": 5 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peak["v"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: peak.update(v=2**30))
    assert step_metrics.peak_memory()["mem/peak_cuda_gb"] == 5.0
    assert step_metrics.peak_memory()["mem/peak_cuda_gb"] == 1.0


def test_flash_attention_2_is_refused_without_flash_attn(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(ModelLoadError, match="attn_implementation=flash_attention_2 needs the flash-attn package"):
        check_attn_implementation("flash_attention_2")
    check_attn_implementation("sdpa")


def test_completion_seed_layout():
    # 16 prompts x 8 completions: 128 distinct seeds, consecutive from a hashed base, prompt-major.
    seeds = completion_seeds(1234, 16, 8)
    assert len(set(seeds)) == 128 and all(0 <= s < 2**SEED_BITS for s in seeds)
    assert all((seeds[k + 1] - seeds[k]) % 2**SEED_BITS == 1 for k in range(127))
    assert completion_seeds(1234, 16, 8) == seeds  # a function of the seed only (resume samples the same)
    # The runner's per-(seed, rank, step) seeds give disjoint blocks: 2 ranks x 50 steps, 6400 seeds, no repeats.
    from rl_training.runners.rl_batch import sampling_seed

    blocks = [completion_seeds(sampling_seed(0, r, s), 16, 4) for r in range(2) for s in range(50)]
    assert len({x for b in blocks for x in b}) == 100 * 64
    # Before the fix, prompt i was seeded s + i and vLLM seeded its child j with s + i + j: 16 x 8 completions
    # had only 16 + 8 - 1 = 23 streams.
    assert len({100 + i + j for i in range(16) for j in range(8)}) == 23
    assert completion_seeds(None, 2, 3) == [None] * 6


def test_multi_rank_cpu_tests_run_on_a_one_gpu_machine(monkeypatch):
    """Issue 29 T2: on a CUDA machine init_distributed takes cuda:LOCAL_RANK, so the 2-rank CPU tests' rank 1
    failed with 'invalid device ordinal' on one GPU. RL_DEVICE=cpu keeps a process on the CPU (the test workers
    set it), and a rank without a GPU of its own is one line naming the fix."""
    from rl_training.base.errors import UserError
    from tests.workers import ddp_worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a world of one: no process group is created by these calls
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RL_DEVICE", raising=False)
    with pytest.raises(UserError, match=r"LOCAL_RANK=1 but this process sees 1 GPU\(s\).*set RL_DEVICE=cpu"):
        dist.init_distributed()
    monkeypatch.setenv("RL_DEVICE", "cpu")
    assert dist.init_distributed().device == torch.device("cpu")
    assert '"RL_DEVICE": "cpu"' in inspect.getsource(ddp_worker._init)
    assert 'RL_DEVICE="cpu"' in inspect.getsource(_timeout_worker)


def test_gpu_tests_that_generate_without_a_sync_sleep_at_level_1():
    """Issue 29 T1 and issue 41 item 1: a test of tests/integration/test_gpu.py that wakes the engine without a sync
    (a bare sleep/wake, or sync_weights patched out to sample stale weights) and then generates reads the weights
    only at level 1; level 2, the default, discards them, and the test would sample freed memory. Read from the
    source (the tests themselves need CUDA): every such test's config has *LEVEL_1."""
    import ast

    source = (REPO / "tests" / "integration" / "test_gpu.py").read_text()
    assert 'LEVEL_1 = ["vllm.sleep_level=1"]' in source
    tree = ast.parse(source)
    unsynced = []
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
            continue
        text = ast.unparse(fn)
        if "backend.sleep()" in text or "'sync_weights'" in text:
            unsynced.append(fn.name)
            assert "*LEVEL_1" in text, f"{fn.name} wakes the engine without a sync at the default sleep level 2"
    assert unsynced == [
        "test_sleep_releases_and_wake_takes_back_the_engine_memory",
        "test_bf16_canary_with_cuda_graphs_and_when_sync_is_skipped",
    ]


def test_torchrun_tests_keep_their_ranks_on_the_cpu(tmp_path):
    """Issue 41, item 1: the 2-rank tests that launch the runner under torchrun took the GPUs on a GPU machine (or
    stopped at rank 1 on a 1-GPU box): only the spawned workers set RL_DEVICE=cpu. Every torchrun launch of the
    tests does now, through torchrun's workers; a gpu-marked test asks for the GPUs."""
    import subprocess

    from tests.helpers import torchrun_cmd

    script = tmp_path / "where.py"
    out = tmp_path / "rank{}.txt"  # one file per rank: their stdout lines interleave
    write = f"open({str(out)!r}.format(os.environ['RANK']), 'w').write(str(os.environ.get('RL_DEVICE')))"
    script.write_text(f"import os\n{write}\n")
    env = {k: v for k, v in os.environ.items() if k != dist.DEVICE_ENV}
    r = subprocess.run(torchrun_cmd(2, script), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [(tmp_path / f"rank{i}.txt").read_text() for i in range(2)] == ["cpu", "cpu"]
    assert dist.DEVICE_ENV not in " ".join(torchrun_cmd(2, script, gpu=True))
