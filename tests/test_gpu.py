"""CUDA-only behaviour: sleep mode's memory effect and the NCCL path. Skipped on machines without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_training import dist
from rl_training.config import load_config
from rl_training.runners import rl_runner

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
TESTCFG = str(REPO / "cfg" / "testconfig.yaml")
CUDA_VLLM = ["rollout.backend=vllm", "vllm.memory_fraction=0.3", "vllm.sleep=true"]


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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "rl_training" / "runners" / "rl_runner.py"),
        "--cfg",
        TESTCFG,
        *run_overrides,
        *CUDA_VLLM,
        "vllm.memory_fraction=0.2",
        "train.total_steps=3",
    ]
    r = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "testconfig" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
