"""Batched multi-turn episodes with a retriever (Search-R1), token in / token out, on any turn-capable backend.

    rollouts = run_episodes(backend, retriever, tokenizer, prompts, spec, episode_spec)   # one call per step

One call: every live episode generates one turn (stops: the `multiturn.stop` strings, EOS, a per-turn cap and
the episode's remaining response budget), then ONE batched `retrieve` for all the episodes that searched, then
the observations are appended and the next turn starts from exactly prompt + everything so far. An episode is
one flat token list: the prompt, each turn's sampled ids exactly as the engine returned them (never decoded
and re-encoded), and each observation tokenized on its own (mask 0). Episodes that run out of tokens or turns
end flagged truncated; the context is never cut from the left.

The function depends on nothing but its arguments (no config, no torch.distributed, no signals), so a producer
thread may call it. Scoring stays with the caller; only the retriever's I/O happens here.

Where it departs from Search-R1 (search_r1/llm_agent/generation.py):
- An episode that samples EOS ends there (Search-R1 keeps generating after an EOS turn until max_turns).
- `max_turns` counts every turn including the answering one, and there is no extra final turn without search.
- An observation that would leave no room for one more sampled token is not appended: the episode ends,
  flagged truncated (nothing would ever train on that trailing observation).

What vLLM 0.32 returns for the token that completes a stop string (v1/engine/detokenizer.py, `update`):
`CompletionOutput.token_ids` ends WITH the token that completed the stop string, whatever
`include_stop_str_in_output` says (that flag only trims `.text`; tokens sampled after it in the same engine
step are dropped, their log-probs too). A token can carry characters past the stop string (BPE merges such as
'</answer>\\n'): they stay, because they were sampled. tests/test_episodes.py checks both flags. The HF backend
cuts its rows at the same place with `turn_end`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rl_training.config import SEARCH_FORMATS
from rl_training.rollout.base import Rollouts, SamplingSpec, completion_seeds
from rl_training.search.retriever import RetrievalStats, Retriever, information_block

# Search-R1's text after a turn that neither searched nor answered (generation.py, execute_predictions).
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let's try again.\n"
)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@dataclass(frozen=True)
class EpisodeSpec:
    """Limits of one episode (config section `multiturn`, plus `search.topk`)."""

    max_turns: int = 4
    max_tokens_per_turn: int = 500
    max_response_tokens: int = 2048  # everything after the prompt: sampled turns and observations
    max_obs_tokens: int = 512  # one observation's tokens; longer ones are cut (from the right) and counted
    topk: int = 3
    stop: tuple[str, ...] = ("</search>", "</answer>")

    @property
    def max_trainable_tokens(self) -> int:
        """The most sampled (trainable) tokens an episode can hold: the Dr-GRPO normaliser's constant."""
        return min(self.max_turns * self.max_tokens_per_turn, self.max_response_tokens)

    @classmethod
    def from_config(cls, cfg) -> EpisodeSpec:
        m = cfg.multiturn
        return cls(
            m.max_turns, m.max_tokens_per_turn, m.max_response_tokens, m.max_obs_tokens, cfg.search.topk, tuple(m.stop)
        )


@dataclass
class TurnSample:
    ids: list[int]  # sampled ids of the turn, the stop-completing token (or EOS) included
    logprobs: list[float]  # the sampler's processed log-prob of each


class TurnGenerator(Protocol):
    """What a backend offers the episode engine: one turn for a batch of contexts."""

    stop_ids: set[int]

    def generate_turn(
        self, contexts: list[list[int]], max_tokens: list[int], seeds: list[int | None], spec: SamplingSpec, stop
    ) -> list[TurnSample]: ...


def turn_end(ids: list[int], tokenizer, stop: tuple[str, ...], stop_ids: set[int], max_tokens: int) -> int:
    """Length of the turn inside a generated row: through the first EOS / stop id, or the token whose text
    completes a stop string (vLLM's rule, module docstring), else `max_tokens`. The tail window holds enough
    tokens for the longest stop string (every non-special token decodes to at least one character)."""
    window = max((len(s) for s in stop), default=0) + 1
    for i, t in enumerate(ids[:max_tokens]):
        if t in stop_ids:
            return i + 1
        if stop:
            tail = tokenizer.decode(ids[max(0, i + 1 - window) : i + 1], skip_special_tokens=True)
            if any(s in tail for s in stop):
                return i + 1
    return min(len(ids), max_tokens)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Each episode's turn t draws from its own stream, a function of (episode seed, t) only: an episode samples
    the same whatever else is in the batch and whichever episodes are still live."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, turn]).generate_state(1, dtype=np.uint64)[0] % 2**63)


@dataclass
class Episode:
    prompt: list[int]
    seed: int | None
    ids: list[int] = field(default_factory=list)  # response tokens: sampled turns and observations
    logprobs: list[float] = field(default_factory=list)  # 0.0 on observation tokens
    mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation
    turn: list[int] = field(default_factory=list)  # turn number (1-based) of sampled tokens, 0 on observations
    turns: int = 0
    searches: int = 0
    invalid: int = 0
    answered: bool = False
    obs_tokens: int = 0
    obs_capped: int = 0
    truncated: str = ""  # "" | "tokens" | "turns"
    done: bool = False

    def sampled(self, s: TurnSample, turn: int) -> None:
        self.ids += s.ids
        self.logprobs += s.logprobs
        self.mask += [1] * len(s.ids)
        self.turn += [turn] * len(s.ids)
        self.turns = turn

    def observe(self, obs: list[int]) -> None:
        self.ids += obs
        self.logprobs += [0.0] * len(obs)
        self.mask += [0] * len(obs)
        self.turn += [0] * len(obs)
        self.obs_tokens += len(obs)

    def summary(self) -> dict:
        return {
            "turns": self.turns,
            "searches": self.searches,
            "invalid": self.invalid,
            "answered": self.answered,
            "obs_tokens": self.obs_tokens,
            "obs_capped": self.obs_capped,
            "truncated": self.truncated,
        }


def parse_action(text: str) -> tuple[str, str]:
    """('search', query) | ('answer', answer) | ('invalid', '') from one turn's sampled text: its first
    complete tag pair, as Search-R1's postprocess_predictions (a turn stops at its first closing tag)."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else ("invalid", "")


def run_episodes(
    gen: TurnGenerator, retriever: Retriever, tokenizer, prompts: list[list[int]], spec: SamplingSpec, es: EpisodeSpec
) -> Rollouts:
    """spec.n episodes per prompt (prompt-major, as `generate`), seeded per episode with `completion_seeds`;
    spec.max_new_tokens is not used (the episode spec sets every limit)."""
    seeds = completion_seeds(spec.seed, len(prompts), spec.n)
    eps = [Episode(p, seeds[i * spec.n + j]) for i, p in enumerate(prompts) for j in range(spec.n)]
    stats, timing = RetrievalStats(), {}
    for turn in range(1, es.max_turns + 1):
        live = [e for e in eps if not e.done]
        if not live:
            break
        budgets = [min(es.max_tokens_per_turn, es.max_response_tokens - len(e.ids)) for e in live]
        t0 = time.perf_counter()
        outs = gen.generate_turn(
            [e.prompt + e.ids for e in live], budgets, [turn_seed(e.seed, turn) for e in live], spec, es.stop
        )
        timing[f"turn{turn}_s"] = time.perf_counter() - t0
        pending: list[tuple[Episode, str | None]] = []  # (episode, query) or (episode, None): invalid action
        for e, out, budget in zip(live, outs, budgets, strict=True):
            e.sampled(out, turn)
            kind, arg = parse_action(tokenizer.decode(out.ids, skip_special_tokens=True))
            if kind == "answer":
                e.answered = e.done = True
            elif out.ids and out.ids[-1] in gen.stop_ids:
                e.done = True  # EOS ends the episode (module docstring)
            elif kind == "search":
                e.searches += 1
                pending.append((e, arg))
            elif len(out.ids) >= budget and budget < es.max_tokens_per_turn:
                e.truncated, e.done = "tokens", True  # cut by the episode's budget, not the turn's cap
            else:
                e.invalid += 1
                pending.append((e, None))
        queries = [q for _, q in pending if q is not None]
        t0 = time.perf_counter()
        result = retriever.retrieve(queries, es.topk) if queries else None
        timing["retrieval_s"] = timing.get("retrieval_s", 0.0) + time.perf_counter() - t0
        if result is not None:
            stats.add(result)
        k = 0
        for e, q in pending:
            if q is None:
                text = INVALID_ACTION
            else:
                text = information_block(result.passages[k], result.errors[k])
                k += 1
            obs = tokenizer(text, add_special_tokens=False).input_ids
            if len(obs) > es.max_obs_tokens:
                obs, e.obs_capped = obs[: es.max_obs_tokens], e.obs_capped + 1
            if len(e.ids) + len(obs) >= es.max_response_tokens:
                e.truncated, e.done = "tokens", True  # no room left to sample after it (module docstring)
            elif turn == es.max_turns:
                e.truncated, e.done = "turns", True
            else:
                e.observe(obs)
    return _to_rollouts(eps, tokenizer, stats, timing)


def _to_rollouts(eps: list[Episode], tokenizer, stats: RetrievalStats, timing: dict) -> Rollouts:
    # The reward sees the sampled text only (search/reward.py's contract): the observations are left out.
    sampled = [[t for t, m in zip(e.ids, e.mask, strict=True) if m] for e in eps]
    return Rollouts(
        prompt_ids=[e.prompt for e in eps],
        completion_ids=[e.ids for e in eps],
        logprobs=[e.logprobs for e in eps],
        truncated=[bool(e.truncated) for e in eps],
        texts=tokenizer.batch_decode(sampled, skip_special_tokens=True),
        loss_mask=[e.mask for e in eps],
        turn_index=[e.turn for e in eps],
        episodes=[e.summary() for e in eps],
        retrieval=stats,
        timing=timing,
    )


def response_budget(cfg) -> int:
    """Tokens after the prompt an episode can reach (0 for single-turn tasks): what the engine's context needs."""
    return cfg.multiturn.max_response_tokens if cfg.data.format in SEARCH_FORMATS else 0


class EpisodeBackend:
    """A RolloutBackend whose `generate` runs episodes on the wrapped backend: the runner, the in-loop eval and
    `evals.run` use it unchanged. Everything else (weights, sleep, metrics, close) is the wrapped backend's."""

    def __init__(self, backend, retriever: Retriever, tokenizer, es: EpisodeSpec):
        self.backend, self.retriever, self.tokenizer, self.es = backend, retriever, tokenizer, es
        self.name = backend.name

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Rollouts:
        return run_episodes(self.backend, self.retriever, self.tokenizer, prompts, spec, self.es)

    def sync_weights(self, model) -> None:
        self.backend.sync_weights(model)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()

    def metrics(self) -> dict[str, float]:
        return self.backend.metrics()

    def close(self) -> None:
        self.retriever.close()
        self.backend.close()

    def __getattr__(self, name: str):
        """Everything else (the server backend's pinned/republish, the engine's lora mode) is the wrapped one's."""
        if name == "backend":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.backend, name)


def with_episodes(cfg, backend, tokenizer):
    """The backend itself for single-turn tasks; wrapped in EpisodeBackend for the search tasks."""
    if cfg.data.format not in SEARCH_FORMATS:
        return backend
    if not hasattr(backend, "generate_turn"):
        raise ValueError(f"rollout.backend={backend.name} cannot run multi-turn episodes (use vllm, hf or server)")
    from rl_training.search.build import make_retriever

    return EpisodeBackend(backend, make_retriever(cfg.search), tokenizer, EpisodeSpec.from_config(cfg))
