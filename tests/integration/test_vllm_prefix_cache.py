"""The colocated vLLM engine shares a group's prompt through its prefix cache on the CPU (vllm.block_size).

vLLM 0.32's CPU attention defaults to 128-token KV blocks and its prefix cache shares only full blocks, so a
prompt under 128 tokens was prefilled again for each of its K completions: on SmolLM2's 52-55-token chat prompts
the generation of a step ran 1.6x slower (docs/real_model.md)."""

from __future__ import annotations

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.kinds import CPU_BLOCK_SIZE
from tests.helpers import TESTCFG, VLLM

pytestmark = pytest.mark.slow


def test_a_groups_completions_reuse_their_prompts_full_blocks(run_overrides):
    """A 75-token prompt, 4 completions, one request each (as VLLMBackend.generate sends them). Expected cached
    tokens, from the block arithmetic: the first request computes everything; each later one finds the prompt's
    floor(75 / 32) = 2 full blocks = 64 tokens cached (the last, partial block is recomputed). At vLLM's CPU default
    of 128 tokens a block, the same prompt fills no block and every request reports 0."""
    from vllm import SamplingParams

    from rl_training.policy.models import build_policy
    from rl_training.rollout.vllm_engine import VLLMBackend

    cfg = load_config(TESTCFG, [*run_overrides, *VLLM, "data.max_prompt_tokens=96"])
    info = dist.init_distributed()
    tokenizer, model = build_policy(cfg, info.device)
    backend = VLLMBackend(cfg, model, tokenizer, info)
    try:
        assert backend.llm.llm_engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE == 32
        prompt = tokenizer.encode("reverse the letters of this rather long line, please, then stop right there ")
        prompt = (prompt * 8)[:75]
        params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s) for s in range(4)]
        first = backend.llm.generate([{"prompt_token_ids": prompt}], params[0], use_tqdm=False)
        rest = backend.llm.generate([{"prompt_token_ids": prompt}] * 3, params[1:], use_tqdm=False)
        assert [o.num_cached_tokens for o in first + rest] == [0, 64, 64, 64]
    finally:
        backend.close()
