"""CUDA-only behaviour: sleep mode's memory effect, bf16 canary bounds with CUDA graphs, and the NCCL path.
Skipped on machines without a GPU; `make gpu-check` runs them (scripts/gpu_check.py, docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.runners import rl_runner
from tests.helpers import REPO, RL_RUNNER, TESTCFG, torchrun_cmd

pytestmark = pytest.mark.gpu
CUDA_VLLM = ["rollout.backend=vllm", "vllm.memory_fraction=0.3", "vllm.sleep=true"]
LEVEL_1 = ["vllm.sleep_level=1"]  # a bare sleep/wake without a sync keeps the weights only at level 1 (T1)
# bf16 as the recipes train, CUDA graphs on (the decode path the recipes use), big steps: stale engine weights
# would show in the canary. Bound: bf16 kernels put trainer and vLLM log-probs ~1e-3-1e-2 apart per token.
BF16_GRAPHS = ["model.dtype=bfloat16", "vllm.enforce_eager=false", "optim.lr=1e-2", "optim.warmup_steps=0"]
BF16_CANARY_MAX = 2e-2


@pytest.fixture(autouse=True)
def _on_the_gpu(monkeypatch):
    """tests/conftest.py keeps every test's runs on the CPU (RL_DEVICE=cpu): these take the GPU, in this process
    (init_distributed) and in the torchrun workers they launch (torchrun_cmd(gpu=True) passes the environment on)."""
    monkeypatch.delenv(dist.DEVICE_ENV, raising=False)


def test_sleep_frees_and_wake_restores_gpu_memory(run_overrides):
    import torch

    cfg = load_config(TESTCFG, [*run_overrides, *CUDA_VLLM])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        assert run.backend.sleep_enabled
        m = rl_runner.rl_step(run, 0)  # generate -> sleep -> train -> wake weights, sync, wake KV cache
        assert m["mem/vllm_sleep_enabled"] == 1.0
        # Level 1 drops the KV cache and moves the weights to host memory: nearly all of the engine's
        # reservation (0.3 x the GPU; the tiny model's weights are a few MB, so the KV cache is almost all of it).
        total_gb = torch.cuda.mem_get_info()[1] / 2**30
        assert m["mem/vllm_sleep_freed_gb"] > 0.2 * total_gb
        assert m["mem/vllm_wake_kv_cache_gb"] > 0.1
        assert m["rollout/logp_diff_mean"] < 1e-2  # bf16/fp32 mix on GPU: looser than the CPU float32 bound
    finally:
        run.backend.close()


def test_two_rank_nccl_run(run_overrides, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    over = [*run_overrides, *CUDA_VLLM, "vllm.memory_fraction=0.2", "train.total_steps=3"]
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *over, gpu=True)
    r = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "testconfig" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]


def free_gb() -> float:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def test_sleep_releases_and_wake_takes_back_the_engine_memory(run_overrides):
    """Measured here with mem_get_info around the backend's own sleep/wake, not from its metrics. Level 1: the
    step after the bare sleep/wake generates before any sync, from the weights the host backup restored."""
    import torch

    cfg = load_config(TESTCFG, [*run_overrides, *CUDA_VLLM, *LEVEL_1])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        rl_runner.rl_step(run, 0)
        run.backend.wake()  # whatever state the step left it in: awake, KV cache allocated
        total = torch.cuda.mem_get_info()[1] / 2**30
        awake = free_gb()
        run.backend.sleep()
        asleep = free_gb()
        run.backend.wake()
        woken = free_gb()
        # 0.3 x the GPU is the engine's; level 1 releases the KV cache and moves the (few MB of) weights to host.
        assert asleep - awake > 0.2 * total
        assert abs(woken - awake) < 0.05 * total  # the same reservation back
        m = rl_runner.rl_step(run, 1)  # weights restored from the host backup, not garbage
        assert m["rollout/logp_diff_mean"] < BF16_CANARY_MAX
    finally:
        run.backend.close()


def test_bf16_canary_with_cuda_graphs_and_when_sync_is_skipped(run_overrides, monkeypatch):
    # Level 1: the skipped sync must leave the engine on the previous step's weights (restored from the host
    # backup), not on the memory level 2 discarded: only then is the "stale" step stale weights (issue 41, item 1)
    cfg = load_config(TESTCFG, [*run_overrides, *CUDA_VLLM, *BF16_GRAPHS, *LEVEL_1])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        synced = [rl_runner.rl_step(run, i) for i in range(3)]  # sleep, wake and sync at every step
        assert all(m["rollout/logp_diff_mean"] < BF16_CANARY_MAX for m in synced)
        assert [m["rollout/weight_version"] for m in synced] == [2.0, 3.0, 4.0]
        assert any(m["train/grad_norm"] > 0 for m in synced)  # the weights did move
        for group in run.optimizer.param_groups:
            group["lr"] = 0.05
        monkeypatch.setattr(run.backend, "sync_weights", lambda model: None)
        rl_runner.rl_step(run, 3)
        stale = rl_runner.rl_step(run, 4)  # sampled from weights a big step old
        # the bound that every synced step met must flag it, or the canary cannot tell stale from bf16 noise
        assert stale["rollout/logp_diff_mean"] > BF16_CANARY_MAX
    finally:
        run.backend.close()


def test_nccl_all_reduce_on_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cmd = torchrun_cmd(2, REPO / "scripts" / "gpu_check.py", "--nccl-worker", gpu=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # ranks contribute 1 and 2: both hold 3 after the sum
    assert sorted(x for x in r.stdout.splitlines() if x.startswith("nccl-sum")) == [
        "nccl-sum rank 0 3.0",
        "nccl-sum rank 1 3.0",
    ]
