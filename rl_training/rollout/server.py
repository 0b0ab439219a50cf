"""rollout.backend=server: trainer ranks are HTTP clients of stock vLLM OpenAI-compatible servers.

Written for vLLM 0.32's HTTP API (`vllm/entrypoints/openai/completion/protocol.py`, `serve/lora`). When to
choose it and the server command lines: docs/server.md. Weight publishing is in `server_sync.py`.

- Each rank sends each of its prompts as token ids in its own /v1/completions request with n = G, naming the
  policy version it samples (`model=policy-v{n}`), so every sequence comes from one known version
  (`Rollouts.policy_version`). The requests of a rank run in parallel (a thread pool of server.concurrency),
  request i of rank r going to urls[(r + i) % len(urls)], and a retry goes to the next URL.
- Seeds: vLLM samples the j-th child of an n > 1 request with seed + j (`v1/engine/parallel_sampling.py`),
  so per-prompt seeds seed + i would make prompt i's child j and prompt i+1's child j-1 share a stream
  (issue 12, item 10). Each request is seeded with the first seed of its prompt's block of
  `completion_seeds` (rollout/base.py): completion k gets seed k's stream, as in the colocated engine.
- Each completion's `Rollouts.policy_version`: the version its request named under server.weight_sync=lora
  (each version a name of its own); under full and nccl, whose served name never changes, the oldest weight-version
  tag any server reports after the batch (server_sync.py, `served_versions`: the answer does not say which
  weights sampled it, so one stale server stops the run whichever requests it served).
- Every sampling knob is sent at its neutral value: a server started without `--generation-config vllm`
  fills unset ones from the model's generation_config.json (Qwen2.5-Instruct: top_k 20, repetition 1.05).
  Sampler log-probs are the processed ones only if the server runs with `--logprobs-mode processed_logprobs`
  (docs/server.md); the rollout/logp_diff_* canary shows a server that does not.
- HTTP with `requests` (installed with vLLM): synchronous calls in threads suit both this loop and the
  per-rank generation thread of an asynchronous one, and the reward time limit stays on the main thread.
  `trust_env=False`: no proxy from the environment ever sees the servers' traffic (PITFALLS: proxies
  intercepting internal traffic).
- Failures: connection errors, timeouts and 5xx are retried server.retries times with doubling backoff;
  then a one-line ServerError stops the run (a checkpointed run continues with ckpt.resume=latest once the
  server is back). A 4xx is the request's fault and is not retried.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rl_training.base import dist, faults
from rl_training.base.errors import one_line
from rl_training.rollout.base import Rollouts, SamplingSpec, completion_seeds, split_completion
from rl_training.rollout.server_client import ServerClient, ServerError, base_model_name

VLLM_VERSION_WRITTEN_FOR = "0.32.0"


def request_seeds(seed: int, n_requests: int, n: int) -> list[int]:
    """One seed per n-sample request: the first of its prompt's block of `completion_seeds`, so child j (seed
    s + j in vLLM) is exactly the completion the colocated engine samples with that seed."""
    return completion_seeds(seed, n_requests, n)[::n]


class ServerBackend:
    name = "server"

    def __init__(self, cfg, model, tokenizer, dist_info, start_version: int = 0):
        """`start_version`: the optimizer steps the weights at build have taken (a resumed run's step), so that
        version n is the policy after n steps across resumes too."""
        from rl_training.config.schema import derive
        from rl_training.rollout.hf import stop_token_ids
        from rl_training.rollout.server_sync import make_publisher, served_name

        s = cfg.server
        self.client = ServerClient(s.urls, s.timeout_s, s.retries, s.backoff_s, s.concurrency)
        self.weight_sync = s.weight_sync
        self.rank = dist_info.rank
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.client.wait_healthy(s.startup_timeout_s)
        run_dir = derive(cfg, dist_info.world_size).run_dir
        self.publisher = make_publisher(cfg, self.client, run_dir, dist_info) if dist_info.is_main else None
        # Full-weight syncs sample the server's base model: its served name unless configured
        base = s.served_model or (base_model_name(self.client) if s.weight_sync != "lora" else "")
        self.served_name = lambda version: served_name(cfg, version, base)
        self.version = start_version - 1  # published: start_version = the weights at build, +1 per sync
        self._pin = threading.local()  # a thread's pinned sampling version (the async producer's, `pinned`)
        self.publish_s = 0.0
        # The trainer may already differ from the files on disk (resume, or a merged SFT start).
        self.sync_weights(model)

    # ------------------------------------------------------------------------------------- generation
    def _body(self, prompt: list[int], spec: SamplingSpec, model: str, seed: int | None) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "n": spec.n,
            "max_tokens": spec.max_new_tokens,
            "min_tokens": spec.min_new_tokens,
            "temperature": 0.0 if spec.greedy else spec.temperature,
            "top_p": 1.0 if spec.greedy else spec.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": seed,
            "stop_token_ids": sorted(self.stop_ids),
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,
            "skip_special_tokens": True,
        }

    def generate(
        self, prompts: list[list[int]], spec: SamplingSpec, examples=None, *, version: int | None = None
    ) -> Rollouts:
        """G completions per prompt from policy `version` (default: the thread's pinned one, else the newest);
        `examples` are not needed for single-turn generation."""
        if version is None:
            version = getattr(self._pin, "version", None)
        version = self.version if version is None else version
        if faults.injected("server.older_version") and version > 0:  # a backend asking for the wrong version
            version -= 1
        model = self.served_name(version)
        seeds = (
            request_seeds(spec.seed, len(prompts), spec.n)
            if spec.seed is not None and not spec.greedy
            else [None] * len(prompts)
        )
        futures = [
            self.client.pool.submit(
                self.client.request, "POST", "/v1/completions", self._body(p, spec, model, sd), url=self.rank + i
            )
            for i, (p, sd) in enumerate(zip(prompts, seeds, strict=True))
        ]
        prompt_ids, completions, logprobs, truncated = [], [], [], []
        for p, fut in zip(prompts, futures, strict=True):
            answer = fut.result()
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != spec.n or any(c["prompt_token_ids"] != p for c in choices):
                raise ServerError(f"server answered {len(choices)} completions of another prompt (model {model})")
            for c in choices:
                toks, _ = split_completion(list(c["token_ids"]), self.stop_ids)
                prompt_ids.append(p)
                completions.append(toks)
                logprobs.append([float(x) for x in c["logprobs"]["token_logprobs"][: len(toks)]])
                truncated.append(c["finish_reason"] == "length")
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        sampled = self._sampled_version(version)
        return Rollouts(prompt_ids, completions, logprobs, truncated, texts, [sampled] * len(completions))

    def _sampled_version(self, requested: int) -> int:
        """The policy version that sampled a batch that asked for `requested` (module docstring)."""
        if self.weight_sync == "lora":
            return requested
        from rl_training.rollout.server_sync import served_versions

        return min(served_versions(self.client).values())

    @contextmanager
    def pinned(self, version: int):
        """Every generate() of this thread inside the block samples `version` (all turns of an episode too)."""
        self._pin.version = version
        try:
            yield
        finally:
            self._pin.version = None

    def generate_turn(self, contexts, max_tokens, seeds, spec: SamplingSpec, stop) -> list:
        """One turn of multi-turn episodes (rollout/episodes.py) from the thread's pinned version, else the
        newest: one n=1 request per context with its own seed and cap, stopping at the stop strings or EOS. The server's
        `token_ids` end with the token that completed a stop string (the engine's rule, episodes.py)."""
        from rl_training.rollout.episodes import TurnSample

        version = getattr(self._pin, "version", None)
        version = self.version if version is None else version
        model = self.served_name(version)
        bodies = [
            {**self._body(c, replace(spec, n=1, max_new_tokens=m), model, sd), "stop": list(stop)}
            for c, m, sd in zip(contexts, max_tokens, seeds, strict=True)
        ]
        futures = [
            self.client.pool.submit(self.client.request, "POST", "/v1/completions", b, url=self.rank + i)
            for i, b in enumerate(bodies)
        ]
        turns = []
        for c, fut in zip(contexts, futures, strict=True):
            (choice,) = fut.result()["choices"]
            if choice["prompt_token_ids"] != c:
                raise ServerError(f"server answered another context (model {model})")
            ids = list(choice["token_ids"])
            turns.append(TurnSample(ids, [float(x) for x in choice["logprobs"]["token_logprobs"][: len(ids)]]))
        sampled = self._sampled_version(version)
        return [replace(t, version=sampled) for t in turns]

    # ------------------------------------------------------------------------------------- weight sync
    def sync_weights(self, model) -> None:
        """Rank 0 publishes the next version to every server; every rank waits until it is loaded there."""
        t0 = time.perf_counter()
        self._on_rank0(lambda p: p.publish(model, self.version + 1))
        self.version += 1
        self.publish_s = time.perf_counter() - t0

    def republish(self, version: int, adapter_dir: Path) -> None:
        """Load a saved adapter (a resumed run's past version) into every server as policy-v{version}."""
        self._on_rank0(lambda p: p.republish(adapter_dir, version))

    def _on_rank0(self, fn) -> None:
        """fn(publisher) on rank 0. Collective: rank 0's outcome is broadcast, so a refused publish is the same
        one-line error on every rank instead of a hang in a barrier."""
        error, original = None, None
        if self.publisher is not None:
            try:
                fn(self.publisher)
            except (ServerError, OSError) as e:
                error = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
            except Exception as e:  # noqa: BLE001 -- any failure (an NCCL one) must reach every rank before a collective
                error, original = f"weight publish failed on rank 0: {one_line(e)}", e
        error = dist.broadcast_object(error)
        if original is not None:
            raise original  # rank 0 keeps its traceback; the other ranks stop with the one line below
        if error:
            raise ServerError(error)

    def version_dirs(self, versions) -> dict[int, Path]:
        """Rank 0: the published directories of `versions` (for the checkpoint); {} elsewhere."""
        return self.publisher.dirs(versions) if self.publisher is not None else {}

    def sleep(self) -> None:
        pass  # the servers own their memory; nothing of theirs lives in the trainer's process

    def wake(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/weight_version": float(self.version),
            "rollout/server_retries": float(self.client.retried),
            "perf/publish_s": self.publish_s,
        }

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.client.close()
