"""Batched multi-turn episodes of any Environment (rl_training/tasks), token in / token out, on any backend.

    rollouts = run_episodes(backend, env, tokenizer, prompts, examples, spec, episode_spec)   # one call per step

One call: every live episode generates one turn (stops: the environment's stop strings or multiturn.stop, EOS,
a per-turn cap and the episode's remaining response budget), then ONE `env.step_batch` for all of them (a
search environment makes one batched retrieval of it), then the observations are appended and the next turn
starts from exactly prompt + everything so far. An episode is one flat token list: the prompt, each turn's
sampled ids exactly as the engine returned them (never decoded and re-encoded), and each observation tokenized
on its own as plain text, so that text looking like a control token (`<|im_end|>`, the EOS string) stays text
(tasks/tools.py `encode_plain`), or given as ids by the environment; mask 0. Episodes that run out of tokens or
turns end flagged truncated; the context is never cut from the left. Nothing here knows a task family: what a
turn means is the environment's business.

The function depends on nothing but its arguments (no config, no torch.distributed, no signals), so a producer
thread may call it. Scoring stays with the caller; only the environment's own I/O happens here.

- `max_turns` counts every turn including the answering one, and there is no extra final turn.
- Nothing an environment does stops the run: a `reset`, `step` or `step_batch` that raises ends the episodes it
  was serving (one episode for `reset` and `step`; every episode of the call for an overridden `step_batch`),
  and a Step the engine cannot use (an observation that is neither text nor token ids of the vocabulary, a count
  it did not declare or that is not a finite number) ends its episode. Each such episode keeps what it sampled,
  is graded as usual, and says why in its summary (`error`: "env_error: ..." or "env_invalid: ..."); they are
  counted (rollout/env_errors, rollout/env_invalid) and written to the samples. A text observation is cut to
  multiturn.max_obs_tokens before it is tokenized whole (data/text.py): its cost follows the budget.
- An observation that would leave no room for one more sampled token is not appended: the episode ends,
  flagged truncated (nothing would ever train on that trailing observation).

What vLLM 0.32 returns for the token that completes a stop string (v1/engine/detokenizer.py, `update`):
`CompletionOutput.token_ids` ends WITH the token that completed the stop string, whatever
`include_stop_str_in_output` says (that flag only trims `.text`; tokens sampled after it in the same engine
step are dropped, their log-probs too). A token can carry characters past the stop string (BPE merges such as
'</answer>\\n'): they stay, because they were sampled. The episode tests check both flags. The HF backend
cuts its rows at the same place with `turn_end`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rl_training.base.errors import one_line
from rl_training.data.sources import Example
from rl_training.data.text import clean_text, encode_observation
from rl_training.rollout.base import Rollouts, SamplingSpec, VersionedBackend, completion_seeds
from rl_training.tasks.base import Environment, Step, Turn

MAX_COUNT = 2**53  # a Step's count past it is no count (exact as a float, summed across ranks as one)
ERROR_KINDS = ("env_error", "env_invalid")  # why an environment ended an episode (Episode.error's prefix)


@dataclass(frozen=True)
class EpisodeSpec:
    """Limits of one episode (config section `multiturn`) and the strings that end a turn."""

    max_turns: int = 4
    max_tokens_per_turn: int = 500
    max_response_tokens: int = 2048  # everything after the prompt: sampled turns and observations
    max_obs_tokens: int = 512  # one observation's tokens; longer ones are cut (from the right) and counted
    stop: tuple[str, ...] = ()

    @property
    def max_trainable_tokens(self) -> int:
        """The most sampled (trainable) tokens an episode can hold: the Dr-GRPO normaliser's constant."""
        return min(self.max_turns * self.max_tokens_per_turn, self.max_response_tokens)

    @classmethod
    def from_config(cls, cfg, env: Environment) -> EpisodeSpec:
        """multiturn.* limits; the stop strings are multiturn.stop when set, else the environment's own."""
        m = cfg.multiturn
        stop = tuple(m.stop) or tuple(env.stop)
        return cls(m.max_turns, m.max_tokens_per_turn, m.max_response_tokens, m.max_obs_tokens, stop)


@dataclass
class TurnSample:
    ids: list[int]  # sampled ids of the turn, the stop-completing token (or EOS) included
    logprobs: list[float]  # the sampler's processed log-prob of each
    version: int | None = None  # the policy version that sampled the turn (Rollouts.policy_version)


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
    state: Any = None  # the environment's per-episode state (Environment.reset)
    ids: list[int] = field(default_factory=list)  # response tokens: sampled turns and observations
    logprobs: list[float] = field(default_factory=list)  # 0.0 on observation tokens
    mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation
    turn: list[int] = field(default_factory=list)  # turn number (1-based) of sampled tokens, 0 on observations
    turns: int = 0
    counts: dict[str, float] = field(default_factory=dict)  # the environment's episode_counts
    obs_tokens: int = 0
    obs_capped: int = 0
    truncated: str = ""  # "" | "tokens" | "turns"
    error: str = ""  # "" | "env_error: <one line>" | "env_invalid: <why>": the environment ended the episode
    done: bool = False
    version: int | None = None  # the oldest policy version among its sampled turns

    def fail(self, kind: str, why: str) -> None:
        self.error, self.done = f"{kind}: {clean_text(why)[:500]}", True

    def sampled(self, s: TurnSample, turn: int) -> None:
        self.ids += s.ids
        self.logprobs += s.logprobs
        self.mask += [1] * len(s.ids)
        self.turn += [turn] * len(s.ids)
        self.turns = turn
        if s.version is not None:
            self.version = s.version if self.version is None else min(self.version, s.version)

    def observe(self, obs: list[int]) -> None:
        self.ids += obs
        self.logprobs += [0.0] * len(obs)
        self.mask += [0] * len(obs)
        self.turn += [0] * len(obs)
        self.obs_tokens += len(obs)

    def add(self, counts: dict[str, float]) -> None:
        for k, v in counts.items():
            self.counts[k] += v

    def summary(self) -> dict:
        """What samples, eval records and the episode metrics read: turns, the environment's counts (an int
        where it is one), observation tokens, caps and how the episode was truncated."""
        counts = {k: int(v) if float(v).is_integer() else v for k, v in self.counts.items()}
        return {
            "turns": self.turns,
            **counts,
            "obs_tokens": self.obs_tokens,
            "obs_capped": self.obs_capped,
            "truncated": self.truncated,
            "error": self.error,
        }


def run_episodes(
    gen: TurnGenerator,
    env: Environment,
    tokenizer,
    prompts: list[list[int]],
    examples: Sequence[Example],
    spec: SamplingSpec,
    es: EpisodeSpec,
) -> Rollouts:
    """spec.n episodes per prompt (prompt-major, as `generate`), seeded per episode with `completion_seeds`;
    examples[i] is prompt i's problem (Environment.reset). spec.max_new_tokens is not used (the episode spec
    sets every limit)."""
    if len(examples) != len(prompts):
        raise ValueError(f"run_episodes: {len(examples)} examples for {len(prompts)} prompts")
    seeds = completion_seeds(spec.seed, len(prompts), spec.n)
    eps = [
        _start(env, p, ex, seeds[i * spec.n + j])
        for i, (p, ex) in enumerate(zip(prompts, examples, strict=True))
        for j in range(spec.n)
    ]
    stats, timing = env.call_stats(), {}
    vocab = len(tokenizer)
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
        turns = []
        for e, out, budget in zip(live, outs, budgets, strict=True):
            e.sampled(out, turn)
            eos = bool(out.ids) and out.ids[-1] in gen.stop_ids
            # cut by the episode's budget, not the turn's own cap: nothing more can be sampled after it
            exhausted = not eos and len(out.ids) >= budget and budget < es.max_tokens_per_turn
            text = tokenizer.decode(out.ids, skip_special_tokens=True)
            turns.append(Turn(text, list(out.ids), turn, eos, exhausted))
        t0 = time.perf_counter()
        steps = _steps(env, live, turns, stats)
        timing["env_s"] = timing.get("env_s", 0.0) + time.perf_counter() - t0
        for e, step in zip(live, steps, strict=True):
            if step is not None:
                _apply(e, step, turn, tokenizer, es, vocab)
    return _to_rollouts(eps, tokenizer, stats, timing)


def _start(env: Environment, prompt: list[int], example: Example, seed: int | None) -> Episode:
    e = Episode(prompt, seed, counts=dict.fromkeys(env.episode_counts, 0))
    try:
        e.state = env.reset(example)
    except Exception as exc:  # noqa: BLE001 -- an environment's failure ends its episode, never the run
        e.fail("env_error", f"{type(env).__name__}.reset raised {one_line(exc)}")
    return e


def _steps(env: Environment, live: list[Episode], turns: list[Turn], stats: Any) -> list[Step | None]:
    """The environment's answers for the live episodes; None for an episode whose environment raised (it is
    ended, with why). An environment with the default step_batch is asked one episode at a time, so a raise ends
    only its own episode; an overridden step_batch serves the batch at once (one retrieval), so its raise, or a
    wrong number of steps, ends every episode of the call."""
    if type(env).step_batch is Environment.step_batch:
        out: list[Step | None] = []
        for e, t in zip(live, turns, strict=True):
            try:
                out.append(env.step(e.state, t))
            except Exception as exc:  # noqa: BLE001 -- the episode ends, counted; the run goes on
                e.fail("env_error", f"{type(env).__name__}.step raised {one_line(exc)}")
                out.append(None)
        return out
    try:
        steps = env.step_batch([e.state for e in live], turns, stats)
        if not isinstance(steps, list | tuple) or len(steps) != len(live):
            n = len(steps) if isinstance(steps, list | tuple) else type(steps).__name__
            raise ValueError(f"returned {n} steps for {len(live)} turns")
        return list(steps)
    except Exception as exc:  # noqa: BLE001 -- a batch that fails ends the episodes it served, counted
        for e in live:
            e.fail("env_error", f"{type(env).__name__}.step_batch raised {one_line(exc)}")
        return [None] * len(live)


def _invalid(step: Any, env_counts: dict[str, float], vocab: int) -> str:
    """Why the engine cannot use `step` ('' when it can): a Step whose observation is None, text or ids of the
    vocabulary, and whose counts are declared episode counts with finite numbers."""
    try:
        return _step_problem(step, env_counts, vocab)
    except Exception as exc:  # noqa: BLE001 -- a Step whose parts raise when read is not usable either
        return f"the step cannot be read ({one_line(exc)})"


def _step_problem(step: Any, env_counts: dict[str, float], vocab: int) -> str:
    if not isinstance(step, Step):
        return f"step is a {type(step).__name__}, not a Step"
    obs = step.observation
    if obs is not None and not isinstance(obs, str):
        if not isinstance(obs, list | tuple):
            return f"observation is a {type(obs).__name__}, not text or token ids"
        for i, t in enumerate(obs):
            if type(t) is not int or not 0 <= t < vocab:
                return f"observation[{i}] is {_shown(t)}, not a token id of the vocabulary (0..{vocab - 1})"
    if not isinstance(step.counts, dict):
        return f"counts is a {type(step.counts).__name__}, not a dict"
    for k, v in step.counts.items():
        if not isinstance(k, str) or k not in env_counts:
            return f"Step.counts has {clean_text(repr(k))[:60]}, which is not one of the environment's episode_counts"
        if type(v) not in (int, float, bool) or not (type(v) is int or math.isfinite(v)) or abs(v) > MAX_COUNT:
            return f"Step.counts[{k!r}] is {_shown(v)}, not a count"
    return ""


def _shown(x: Any) -> str:
    """A value for an error message, short and total (an int past the str limit is named by its size)."""
    if type(x) is int:
        return f"the int {x}" if abs(x) < 10**30 else f"an int of {x.bit_length()} bits"
    return f"a {type(x).__name__} {clean_text(repr(x))[:40]}"


def _apply(e: Episode, step: Step, turn: int, tokenizer, es: EpisodeSpec, vocab: int) -> None:
    """One environment answer: the end of the episode, or its observation appended within the limits."""
    why = _invalid(step, e.counts, vocab)
    if why:
        e.fail("env_invalid", why)
        return
    e.add(step.counts)
    if step.done:
        e.done = True
        return
    obs = step.observation
    if obs is None:
        obs, capped = [], False
    elif isinstance(obs, str):  # an observation is data: it never forges a special token; cut before tokenizing
        obs, capped = encode_observation(tokenizer, obs, es.max_obs_tokens)
    else:
        obs, capped = list(obs[: es.max_obs_tokens]), len(obs) > es.max_obs_tokens
    e.obs_capped += capped
    if len(e.ids) + len(obs) >= es.max_response_tokens:
        e.truncated, e.done = "tokens", True  # no room left to sample after it (module docstring)
    elif turn == es.max_turns:
        e.truncated, e.done = "turns", True
    else:
        e.observe(obs)


def episode_versions(eps: list[Episode]) -> list[int] | None:
    """Each episode's policy version: its turns' oldest (an episode ended before its first turn, which sampled
    nothing, takes the batch's oldest); None when the backend reports no version."""
    known = [e.version for e in eps if e.version is not None]
    if not known:
        return None
    return [min(known) if e.version is None else e.version for e in eps]


def _to_rollouts(eps: list[Episode], tokenizer, stats: Any, timing: dict) -> Rollouts:
    # The grader sees the sampled text only: neither the prompt nor an observation can score.
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
        policy_version=episode_versions(eps),
        env_stats=stats,
        timing=timing,
    )


class EpisodeBackend:
    """A RolloutBackend whose `generate` runs episodes of `env` on the wrapped backend: the runner, the in-loop
    eval and `evals.run` use it unchanged. Everything else (weights, sleep, metrics, close) is the wrapped
    backend's; the environment's resources are the task's (Task.start / close)."""

    def __init__(self, backend, env: Environment, tokenizer, es: EpisodeSpec):
        self.backend, self.env, self.tokenizer, self.es = backend, env, tokenizer, es
        self.name = backend.name

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, examples: Sequence[Example] | None = None):
        if examples is None:
            raise ValueError("multi-turn generation needs the examples of the prompts (Environment.reset)")
        return run_episodes(self.backend, self.env, self.tokenizer, prompts, examples, spec, self.es)

    def sync_weights(self, model) -> None:
        self.backend.sync_weights(model)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()

    def metrics(self) -> dict[str, float]:
        return self.backend.metrics()

    def close(self) -> None:
        self.backend.close()


class VersionedEpisodeBackend(EpisodeBackend):
    """Episodes on a VersionedBackend (the server's): its versions, pinned per thread, are the wrapped one's."""

    def pinned(self, version: int):
        return self.backend.pinned(version)

    def republish(self, version: int, adapter_dir) -> None:
        self.backend.republish(version, adapter_dir)

    def version_dirs(self, versions):
        return self.backend.version_dirs(versions)


def episode_budget(cfg, task) -> int:
    """Tokens after the prompt an episode can reach: multiturn.max_response_tokens for an Environment, else 0
    (what the engine's context must hold beyond the single-turn limits)."""
    return cfg.multiturn.max_response_tokens if isinstance(task, Environment) else 0


def max_trainable_tokens(cfg, task) -> int:
    """Dr-GRPO's constant: rollout.max_new_tokens, or an episode's most sampled tokens for an Environment."""
    if isinstance(task, Environment):
        return EpisodeSpec.from_config(cfg, task).max_trainable_tokens
    return cfg.rollout.max_new_tokens


def with_episodes(cfg, backend, tokenizer, task):
    """The backend itself for a single-turn task; wrapped in EpisodeBackend for an Environment."""
    if not isinstance(task, Environment):
        return backend
    if not callable(getattr(backend, "generate_turn", None)):
        raise ValueError(f"rollout.backend={backend.name} cannot run multi-turn episodes: it has no generate_turn")
    wrapper = VersionedEpisodeBackend if isinstance(backend, VersionedBackend) else EpisodeBackend
    return wrapper(backend, task, tokenizer, EpisodeSpec.from_config(cfg, task))
