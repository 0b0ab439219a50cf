"""The rollout-backend interface: generate groups of completions, take new weights, sleep and wake.

A backend is chosen once at setup from `rollout.backend` (see `rollout/factory.py`). The loop only calls these
methods; memory juggling (sleep/wake) and any engine internals stay inside the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rl_training.base.groups import Groups


@dataclass
class Rollouts:
    """Completions ordered group by group (base/groups.py: which rows answer which prompt)."""

    prompt_ids: list[list[int]]  # [N][prompt_len] prompt tokens of each sequence (shared within a group)
    completion_ids: list[list[int]]  # [N][len_i] sampled tokens, the stop token included when produced
    logprobs: list[list[float]]  # [N][len_i] the sampler's log-prob of each sampled token (after temperature)
    truncated: list[bool]  # [N] stopped by max_new_tokens, not by a stop token
    texts: list[str]  # [N] decoded completions, special tokens removed
    # [N] the policy version (optimizer steps taken by the weights) that sampled each sequence: every built-in
    # backend fills it (the engine's weight-version tag, the server's, the HF model's own); None: a user's backend
    # that does not know it (the weight guard then judges the canary alone)
    policy_version: list[int] | None = None
    # Multi-turn episodes (rollout/episodes.py); None for single-turn completions.
    loss_mask: list[list[int]] | None = None  # [N][len_i] 1 on sampled tokens, 0 on observations; None: all ones
    turn_index: list[list[int]] | None = None  # [N][len_i] 1-based turn of each sampled token, 0 on observations
    episodes: list[dict] | None = None  # [N] per-episode counts (Episode.summary: turns, the environment's, ...)
    env_stats: Any = None  # the call's Environment.call_stats() (a search task's retrieval latencies, failures)
    timing: dict[str, float] | None = None  # seconds per turn (turn1_s, ...) and env_s (environment steps)

    def trainable(self, i: int) -> int:
        """Tokens of sequence i the policy sampled (what every loss term and count reads)."""
        return len(self.completion_ids[i]) if self.loss_mask is None else sum(self.loss_mask[i])

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class StepBatch:
    """One step's generated data on this rank, what the learner trains on: the prompts' dataset indices, their
    completions group by group (`groups`: prompt i's are group i) and the example each completion answers."""

    indices: list[int]  # [P] dataset indices of this rank's prompts
    rollouts: Rollouts  # [P * G] sequences, group by group (sum(sizes) with `sizes`)
    group_size: int  # G, the config's completions per prompt
    examples: list  # [P * G] data.sources.Example of each sequence (prompt i's example, G times)
    # [P] prompt i's completions when they differ (rollout.allocation: per_prompt); None: G each
    sizes: list[int] | None = None

    def __post_init__(self):
        rows = len(self.indices) * self.group_size if self.sizes is None else sum(self.sizes)
        shape = f"{len(self.indices)} prompts x {self.group_size}" if self.sizes is None else f"groups {self.sizes}"
        if (self.sizes is not None and len(self.sizes) != len(self.indices)) or not (
            len(self.rollouts) == rows == len(self.examples)
        ):
            raise ValueError(
                f"a step batch of {len(self.indices)} prompts in {shape} needs as many rollouts and examples, "
                f"got {len(self.rollouts)} and {len(self.examples)}"
            )

    @property
    def groups(self) -> Groups:
        """The batch's rows by group (prompt i's completions are group i)."""
        if self.sizes is not None:
            return Groups(tuple(self.sizes))
        return Groups.uniform(len(self.indices), self.group_size)

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, each prompt once; completion tokens) of the batch: what generating it read and wrote."""
        ro = self.rollouts
        return sum(len(ro.prompt_ids[s]) for s in self.groups.starts), sum(len(c) for c in ro.completion_ids)


@dataclass(frozen=True)
class SamplingSpec:
    n: int  # completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None  # per-call sampling seed: every completion of the call gets its own stream from it
    min_new_tokens: int = 0  # stop tokens masked until this many (fixed-length benchmarks); 0 = off


SEED_BITS = 63  # a torch.Generator (what vLLM seeds per request) takes any non-negative int64


def completion_seeds(seed: int | None, n_prompts: int, n: int) -> list[int | None]:
    """One sampling seed per completion, prompt-major (prompt i's j-th completion at i * n + j), or all None.
    Every backend samples completion k from the stream of seed k: the colocated engine with one n=1 request per
    completion, the server backend with one n-sample request per prompt seeded with its block's first seed
    (vLLM seeds child j of a request seeded s with s + j), so both draw the same tokens for the same seed.

    Consecutive integers from a 63-bit base hashed from `seed` (numpy's SeedSequence): a call's completions
    have distinct streams for certain, and two calls' blocks of seeds overlap with probability about
    2 * (completions per call) / 2^63 (each call's `seed` is itself a hash of (seed, rank, step))."""
    if seed is None:
        return [None] * (n_prompts * n)
    import numpy as np

    total = n_prompts * n
    # base < 2^63 - total: no seed of the block wraps, and the server backend's per-prompt requests (seed
    # base + i*n, children + j) stay within vLLM's int64 seeds.
    base = int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)[0]) % (2**SEED_BITS - total)
    return [base + k for k in range(total)]


@dataclass(frozen=True)
class BackendContext:
    """What every backend is built from (rollout/factory.py): a user's backend factory gets it as `ctx`."""

    cfg: Any  # the resolved Config
    model: Any  # the policy (peft model): its weights are what sync_weights sends
    tokenizer: Any
    dist_info: Any  # base.dist.DistInfo of this process
    start_step: int = 0  # optimizer steps the model has taken (a resumed run's): where weight versions continue
    episode_tokens: int = 0  # tokens an Environment's episode reaches after its prompt (the context must hold them)


@runtime_checkable
class RolloutBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, examples: Sequence | None = None) -> Rollouts:
        """spec.n completions per prompt. `examples` (one per prompt) are what a multi-turn episode backend
        resets its environment with (rollout/episodes.py); single-turn backends need only the prompts."""

    def sync_weights(self, model) -> None:
        """Make the next generate() use the trainer's current weights."""

    def sleep(self) -> None:
        """Release generation memory while the trainer runs."""

    def wake(self) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Backend-specific values to log each step (weight version, memory freed by sleep), logged as rank 0 has
        them (ready values of the step's meter, base/meter.py: not reduced over ranks)."""

    def close(self) -> None:
        """Release the engine; called once after the run's last collective."""


@runtime_checkable
class VersionedBackend(RolloutBackend, Protocol):
    """A backend that serves several policy versions at once (the server backend): what rollout.max_async_level > 0
    needs, checked at setup. Version n is the policy after n optimizer steps."""

    def pinned(self, version: int) -> AbstractContextManager:
        """Every generate() of this thread inside the block samples `version`."""

    def republish(self, version: int, adapter_dir: Path) -> None:
        """Serve a saved adapter (a resumed run's past version) as `version` again."""

    def version_dirs(self, versions) -> dict[int, Path]:
        """Where the served `versions` are saved (rank 0; {} elsewhere), for the checkpoint to keep them."""


def split_completion(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Cut a generated row at its first stop token (kept). Returns (tokens, truncated).

    Rows that never stop are exactly max_new_tokens long (generation only ends early when all rows
    stopped), so nothing after the cut is a sampled token.
    """
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], False
    return tokens, True
