"""The config sections of generation: how completions are sampled (rollout, vllm, server), run as episodes
(multiturn, search) and scored (reward, sandbox). rl_training/config/schema.py assembles them with the training
sections into the one Config tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rl_training.config.fields import _f


@dataclass
class RewardCfg:
    timeout_s: float = _f(5.0, "Per-completion time limit of a reward function; over it scores 0.", gt=0)
    overlong_buffer: int = _f(
        0,
        "DAPO's soft overlong punishment: responses longer than the budget (rollout.max_new_tokens, or a multi-turn "
        "episode's trainable tokens) minus this many tokens lose up to reward.overlong_penalty, linearly to the "
        "budget (algs/shaping.py; reward/overlong_penalty_mean); 0 = off.",
        ge=0,
    )
    overlong_penalty: float = _f(1.0, "The penalty at the budget (reward.overlong_buffer).", ge=0)


@dataclass
class SandboxCfg:
    workers: int = _f(
        0,
        "Sandbox workers per rank for the code tasks; 0 = 4 per core of the rank's share of the node (the node's "
        "cores / its ranks, at most the rank's affinity mask; docs/code.md).",
        ge=0,
    )
    mode: Literal["strict", "weak"] = _f(
        "strict",
        "strict: bubblewrap with user/pid/net/ipc/uts namespaces, refused where they are unavailable; weak: "
        "rlimits and an unprivileged uid only, warned and counted (reward/sandbox_weak) every step.",
    )
    memory_mb: int = _f(1024, "Address-space limit (RLIMIT_AS) of each program, MiB.", ge=64)
    output_kb: int = _f(1024, "Largest reply (a returned value, a test's stdout) read from a program, KiB.", ge=1)


@dataclass
class RolloutCfg:
    backend: str = _f(
        "auto",
        "Generation backend: a built-in one, auto = vllm if installed, or your own, 'path/to/file.py:NAME' or "
        "'package.module:NAME' (docs/extending.md).",
    )
    backend_args: dict[str, Any] = _f({}, "Keyword arguments of a user backend's class or factory (a mapping).")
    prompts_per_step: int = _f(16, "Prompt groups per optimizer step, summed over ranks.", ge=1)
    group_size: int = _f(8, "Completions per prompt (G); with group_size_auto, the first split's.", ge=2)
    group_size_auto: bool = _f(
        False,
        "rollout.group_size: auto. At checkpoint boundaries the step's budget of prompts_per_step x group_size "
        "completions is split again as the rollout-budget advisor recommends, where it is trusted and the current "
        "group_size lies outside its K* band; prompts per step follow (rl_training/probes/group_size.py; "
        "docs/probes.md 10.9). Needs probe.advisor.",
    )
    group_size_min: int = _f(2, "group_size_auto: the smallest group size it may choose.", ge=2)
    group_size_max: int = _f(0, "group_size_auto: the largest group size it may choose; 0 = 2 x group_size.", ge=0)
    max_new_tokens: int = _f(32, "Generation limit; also the Dr-GRPO normaliser's length.", ge=1)
    min_new_tokens: int = _f(
        0,
        "Stop tokens masked until this many (<= max_new_tokens); 0 = off. For fixed-length benchmarks "
        "(scripts/bench_scaling.py): the sampler then differs from the policy the trainer scores.",
        ge=0,
    )
    temperature: float = _f(1.0, "Sampling temperature (the trainer scales logits the same way).", gt=0)
    top_p: float = _f(
        1.0,
        "Nucleus sampling mass. <1 refuses loss.correction (why: docs/rollout.md, 'Log-probs and the canary').",
        gt=0,
        le=1,
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO's dynamic sampling: after scoring, refill the groups whose rewards all tie (zero advantage) with "
        "groups of newly drawn prompts until the step trains on prompts_per_step informative groups "
        "(rl_training/rollout/refill.py; counted as rollout/refill_* and rollout/completions_generated).",
    )
    dynamic_sampling_max_rounds: int = _f(
        3,
        "Refill rounds a step may run (each draws about the missing groups over the informative fraction seen); "
        "short after the last, the step keeps some tied groups (zero gradient).",
        ge=1,
    )
    allocation: Literal["fixed", "per_prompt"] = _f(
        "fixed",
        "fixed: group_size completions for every prompt. per_prompt: the same budget (prompts_per_step x "
        "group_size) spread over the step's prompts by their estimated pass rates, a cheap first round for a prompt "
        "never seen, its reward history for one seen (rl_training/probes/allocation.py; docs/probes.md 10.7).",
    )
    allocation_first: int = _f(2, "per_prompt: completions of a never-seen prompt's first round.", ge=1)
    allocation_k_max: int = _f(0, "per_prompt: the most completions one prompt gets; 0 = 2 x group_size.", ge=0)
    allocation_ratio: float = _f(
        0.0,
        "per_prompt: r = tr S_w / tr S_b, the within- over between-prompt gradient noise (probe/anova/"
        "within_between_ratio measures it); past about r completions a prompt's next one teaches less than another "
        "prompt's. 0 = group_size.",
        ge=0,
    )
    gen_batch_size: int = _f(256, "Sequences per HF generate call (memory bound).", ge=1)
    max_async_level: int = _f(
        0,
        "K: batch t is sampled by the policy of step max(0, t-K) while the trainer trains earlier batches "
        "(a generation thread per rank); 0 = synchronous. K > 0 needs a versioned backend (server), lora sync and "
        "a loss.correction.",
        ge=0,
        le=64,
    )
    canary_max_logp_diff: float = _f(
        0.0,
        "Weight-state guard: a step whose rollout/logp_diff_mean (trainer vs sampler log-prob) is above this counts "
        "against the sampled weights; 0 = by model.dtype: 1e-3 float32, 5e-2 bfloat16/float16 (docs/rollout.md).",
        ge=0,
    )
    canary_stop_steps: int = _f(
        3,
        "Checkpoint and stop the run (exit status 70) after this many steps in a row over "
        "rollout.canary_max_logp_diff (judged with max_async_level=0, top_p=1, min_new_tokens=0), or at once when "
        "a batch comes from a policy version outside [t-K, t]; 0 = only log guard/*.",
        ge=0,
    )


@dataclass
class VllmCfg:
    memory_fraction: float = _f(
        0.15,
        "gpu_memory_utilization per rank: share of GPU memory (CPU: of RAM) vLLM reserves for weights + KV cache.",
        gt=0,
        le=1,
    )
    max_model_len: int = _f(
        0, "Longest prompt + completion; 0 = data.max_prompt_tokens + max(rollout, eval).max_new_tokens.", ge=0
    )
    kv_cache_gb: float = _f(
        0.0,
        "KV cache size in GiB per rank; 0 = derive it from memory_fraction. Set it on CPU: "
        "there the fraction is charged with the whole process's RSS, trainer included.",
        ge=0,
    )
    block_size: int = _f(
        0,
        "KV-cache block size in tokens; 0 = auto: 32 on CPU, vLLM's own on GPU. The prefix cache shares only full "
        "blocks, and vLLM's CPU default (128) leaves a group's repeated prompt under 128 tokens recomputed for every "
        "completion (SmolLM2's 52-55-token chat prompts: generation 1.4-1.7x slower, scripts/bench_block_size.py). "
        "The CPU takes multiples of 32.",
        ge=0,
    )
    enforce_eager: bool = _f(True, "Skip CUDA-graph capture (faster start; graphs speed up decoding on GPU).")
    weight_sync: Literal["merge", "lora"] = _f(
        "merge",
        "How the colocated engine gets new weights: merge (the LoRA delta merged into every targeted weight, "
        "pushed in place) or lora (the adapter itself, from a tmpfs dir, through vLLM's LoRA path: a sync that "
        "does not grow with the base model, paid for by LoRA kernels in every decode step). docs/benchmarks.md.",
    )
    sleep: bool = _f(True, "Sleep while the trainer runs, on CUDA; the engine stays awake on CPU.")
    sleep_level: int = _f(
        2,
        "vLLM sleep level: 2 discards the weights (the sync after each update rewrites them all), 1 backs them "
        "up to host memory first (a host copy out and back per step). weight_sync=lora needs 1 (or sleep=false): "
        "it never rewrites the base weights.",
        ge=1,
        le=2,
    )


@dataclass
class ServerCfg:
    urls: list[str] = _f(
        [], "Base URLs of the vLLM OpenAI-compatible servers (rollout.backend=server), e.g. ['http://node1:8000']."
    )
    served_model: str = _f(
        "", "The servers' --served-model-name (weight_sync full/nccl); '' = the base model /v1/models lists."
    )
    weight_sync: Literal["lora", "full", "nccl"] = _f(
        "lora",
        "How new weights reach the servers: lora (versioned adapters via /v1/load_lora_adapter), full (merged "
        "safetensors + /collective_rpc reload_weights, needs VLLM_SERVER_DEV_MODE=1), nccl (CUDA only).",
    )
    adapter_dir: str = _f(
        "", "Where rank 0 publishes weights for the servers to read (a filesystem they share); '' = run_dir/published."
    )
    keep_versions: int = _f(2, "Adapter versions kept loaded per server; older ones are unloaded and deleted.", ge=1)
    timeout_s: float = _f(600.0, "Per-request time limit (a whole completion group, or one publish call).", gt=0)
    retries: int = _f(3, "Retries of a failed request (connection error, timeout, 5xx) before the run stops.", ge=0)
    backoff_s: float = _f(2.0, "Wait before the first retry; it doubles with every further retry.", ge=0)
    startup_timeout_s: float = _f(600.0, "At setup, wait at most this long for every server's /health.", gt=0)
    concurrency: int = _f(64, "Requests a rank keeps in flight (one per prompt group), spread over the urls.", ge=1)
    nccl_port: int = _f(29555, "weight_sync=nccl: rendezvous port on rank 0's host (server i uses port + i).", ge=1)


@dataclass
class SearchCfg:
    """The retriever of the search task family (task.name=search*); docs/search.md."""

    retriever: Literal["bm25", "http", "none"] = _f(
        "bm25", "bm25: in-process over `corpus`; http: a /retrieve server at `url`; none: retrieves nothing (ablation)."
    )
    corpus: str = _f("data/search/corpus.jsonl", 'Corpus jsonl of {"id", "contents"} for retriever=bm25.')
    bm25_index: str = _f("", "retriever=bm25: load the index from this directory, or build and save it there.")
    url: str = _f("", "retriever=http: the server's http://host:port/retrieve (NO_PROXY gets its host).")
    request_shape: Literal["batched", "single"] = _f(
        "batched", "HTTP request shape: batched (Search-R1: all queries in one request) or single (SkyRL: one each)."
    )
    topk: int = _f(3, "Passages per search (Search-R1: 3).", ge=1, le=100)
    timeout_s: float = _f(10.0, "Per HTTP request; a timed-out search becomes an error observation.", gt=0)
    retries: int = _f(2, "Extra HTTP attempts after a connection error, time-out or 5xx status.", ge=0, le=10)


@dataclass
class MultiTurnCfg:
    """Episode limits of a multi-turn task (an Environment; rollout/episodes.py)."""

    max_turns: int = _f(4, "Turns per episode, the answering one included (Search-R1: 4).", ge=1, le=32)
    max_tokens_per_turn: int = _f(500, "Sampled tokens per turn (Search-R1: 500).", ge=1)
    max_response_tokens: int = _f(
        2048,
        "Episode budget after the prompt, sampled and observation tokens; past it the episode ends truncated.",
        ge=1,
    )
    max_obs_tokens: int = _f(512, "Tokens of one observation; longer ones are cut and counted.", ge=1)
    stop: list[str] = _f(
        [],
        "Strings that end a turn (besides EOS), kept in the tokens; [] = the environment's own (search: "
        "</search>, </answer>).",
    )
