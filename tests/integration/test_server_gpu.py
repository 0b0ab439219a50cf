"""CUDA-only: the server backend's NCCL weight transfer (server.weight_sync=nccl). vLLM's NCCL engine fails at
init on CPU ("Cannot access accelerator device"), so this runs only where there are 2 GPUs: the server on
GPU 1, the trainer on cuda:0."""

from __future__ import annotations

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from rl_training.rollout.local_server import VLLMServer
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, perturb_adapter

pytestmark = pytest.mark.gpu


def test_nccl_weight_sync_reaches_the_server(warm_model, run_overrides, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    srv = VLLMServer(
        warm_model,
        tmp_path / "server.log",
        extra_args=("--weight-transfer-config", '{"backend": "nccl"}', "--gpu-memory-utilization", "0.3"),
        env={"CUDA_VISIBLE_DEVICES": "1"},
    ).start()
    overrides = [*run_overrides, "rollout.backend=server", f"server.urls=[{srv.url}]", "server.served_model=base",
                 "server.weight_sync=nccl", "rollout.temperature=0.7"]  # fmt: skip
    run = None
    try:
        run = rl_runner.setup(load_config(TESTCFG, overrides), dist.init_distributed())
        greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
        before = run.backend.generate(run.prompts[:16], greedy).completion_ids
        perturb_adapter(run.model, 0.05, seed=0)
        run.backend.sync_weights(run.model)
        after = run.backend.generate(run.prompts[:16], greedy).completion_ids
        assert after == HFBackend(run.model, run.tokenizer).generate(run.prompts[:16], greedy).completion_ids
        assert after != before
        assert rl_runner.rl_step(run, 0)["rollout/logp_diff_mean"] < 1e-2
    finally:
        if run is not None:
            run.backend.close()
        srv.stop()
