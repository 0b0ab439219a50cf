"""The task interface: what a task family (or a user's task file) gives the trainer, the evals and synthesize.

A `Task` turns data records into `Example`s, renders an example's prompt, and grades a batch of completions
against whole examples. An `Environment` is a Task whose episodes have several turns: after each sampled turn
its `step` returns an observation to append (text or token ids, never trained on) or ends the episode. The
episode engine (rollout/episodes.py) does the token bookkeeping; an environment only reads text and answers.

    class Exact(Task):                                      # single turn: parse + reward is all it needs
        def reward(self, completion, example):
            return float(completion.strip() == example.reference)

Contracts every caller relies on:
- `grade` never has to be safe: `score_completions` wraps it. A per-completion `reward` that raises, runs past
  reward.timeout_s or returns a non-finite value scores 0 and is counted (Scores.errors, timeouts, invalid: logged
  as rollout/reward_fn_errors, all three, and rollout/reward_fn_timeouts; evals as grader_errors, grader_timeouts,
  grader_invalid); a batch `grade` that raises scores the whole batch 0, counted as errors.
- `part_names` / `count_names` are fixed per task, so every rank logs (and reduces) the same keys whatever its
  batch did: reward/<part>_mean and reward/<count>; a name a batch leaves out reads 0.
- Resources (a sandbox pool, a retriever) are built in `start` and released in `close`; a task is built (and a
  user's file imported) before any model loads, and started once the process knows its place in the job.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rl_training.data.prompts import render_prompt
from rl_training.data.sources import DataError, Example

REWARD_TIMEOUT_S = 5.0  # reward.timeout_s's default: the limit of a single `reward` call made outside a run


@dataclass
class Scores:
    """A batch's grades, in completion order. `parts` and `counts` carry what a task knows beyond one reward
    (the metrics logger writes them as reward/<name>_mean and reward/<name>; samples keep the parts)."""

    rewards: list[float]
    correct: list[bool]
    formatted: list[bool]
    errors: int = 0  # the grader raised (scored 0)
    timeouts: int = 0  # the grader exceeded its limit (scored 0)
    invalid: int = 0  # returned a non-finite or non-numeric value (scored 0)
    parts: dict[str, list[float]] = field(default_factory=dict)  # [name][N] reward components per completion
    counts: dict[str, float] = field(default_factory=dict)  # per-batch counters (e.g. failure classes)


@dataclass(frozen=True)
class TaskContext:
    """What `Task.start` may build its resources from: the process's place in the job, its tokenizer, and the
    run's resolved config (a code task's sandbox.*, a search task's search.*)."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # ranks on this node (a per-node resource is split between them)
    tokenizer: Any = None
    cfg: Any = None  # the resolved Config; None outside a run (tests, scripts): the task's defaults


class Task:
    """A single-turn task. Override `reward` (one completion against its example) or `grade` (a whole batch);
    everything else has a default. Attributes are class-level settings a subclass may change."""

    question_key: str = "question"  # the record fields the default `parse` reads
    answer_key: str = "answer"
    correct_threshold: float = 1.0  # reward >= this counts as correct (accuracy, pass@k, synthesize)
    # (lo, hi) that every reward lies in, where the task knows it (the forecast is clipped to it)
    reward_range: tuple[float, float] | None = None
    prompt_template: str = "{question}"  # the task's prompt format; data.prompt_template, when set, replaces it
    part_names: tuple[str, ...] = ()  # named per-completion parts `grade` returns (Scores.parts)
    count_names: tuple[str, ...] = ()  # named per-batch counters `grade` returns (Scores.counts)

    # ------------------------------------------------------------------------------------------------ data
    def parse(self, record: dict, where: str) -> Example:
        """One data record as an Example. `where` ('file:line') belongs in every error: raise DataError."""
        for key in (self.question_key, self.answer_key):
            if key not in record:
                raise DataError(f"{where}: missing key '{key}' (has: {', '.join(map(str, record))})")
            if not isinstance(record[key], str | int | float):
                raise DataError(f"{where}: key '{key}' must be a string, got {type(record[key]).__name__}")
        answer = str(record[self.answer_key])
        return Example(str(record[self.question_key]), answer, answer, where)

    def examples(self, split: str) -> list[Example]:
        """The problems of `split` when the task makes its own (data spec 'task:SPLIT', data/sources.py: the
        generated reasoning-gym splits); a task that reads data files makes none."""
        raise DataError(
            f"data spec 'task:{split}': {type(self).__name__} makes no problems of its own; name its data files in "
            "data.train and data.eval"
        )

    def problem_key(self, example: Example) -> Hashable:
        """What makes two records the same problem (one of them is dropped, pitfall P7): the question text."""
        return example.question

    def template(self, data) -> str:
        """The prompt format in force: data.prompt_template when the config sets one, else the task's own."""
        return data.prompt_template or self.prompt_template

    def render_prompt(self, example: Example, tokenizer, data) -> str:
        """The prompt text of an example: the template around the question, wrapped in the tokenizer's chat
        template when data.use_chat_template says so (one rendering for training, SFT and evaluation)."""
        return render_prompt(
            example.question, self.template(data), tokenizer, data.use_chat_template, data.system_prompt
        )

    # ----------------------------------------------------------------------------------------------- grading
    def reward(self, completion: str, example: Example) -> float:
        """One completion's reward. A task that only defines `grade` (a batch grader) answers through it."""
        if type(self).grade is Task.grade:
            raise NotImplementedError(f"{type(self).__name__} defines neither reward() nor grade()")
        return self.grade([completion], [example], REWARD_TIMEOUT_S).rewards[0]

    def has_answer(self, completion: str) -> bool:
        """The format check (rollout/format_rate, eval format_rate): did the completion commit to an answer."""
        return bool(completion.strip())

    def grade(self, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
        """Scores of completions[i] against examples[i]: `reward` and `has_answer` per completion, each under
        the time limit. Override it to grade a batch at once (a sandbox pool, a grader with per-batch state)."""
        rewards, formatted = [], []
        errors = timeouts = invalid = 0
        for c, ex in zip(completions, examples, strict=True):
            r, out = 0.0, _NO_RESULT
            try:
                out = _within(lambda c=c, ex=ex: self.reward(c, ex), timeout_s)
            except RewardTimeout:
                timeouts += 1
            except Exception:  # noqa: BLE001 -- a user reward may raise anything; it must never stop the run
                errors += 1
            if out is not _NO_RESULT:
                checked = finite_reward(out)
                invalid += checked is None
                r = checked or 0.0
            rewards.append(r)
            # bool() inside the guard: a value whose truth raises is unformatted too, like a check that raises
            formatted.append(guarded(lambda c=c: bool(self.has_answer(c)), timeout_s, False))
        correct = [r >= self.correct_threshold for r in rewards]
        return Scores(rewards, correct, formatted, errors, timeouts, invalid)

    def answer_classes(self, completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
        """maj@k voting: completions with the same class id are the same answer; None = no answer (no vote)."""
        return exact_answer_classes(completions, timeout_s)

    # --------------------------------------------------------------------------------------------- resources
    def start(self, ctx: TaskContext | None = None) -> None:
        """Build this process's resources (a sandbox pool, a retriever); fail here, not at the first batch.
        `ctx` is None outside a run (tests, scripts): use the defaults."""

    def close(self) -> None:
        """Release them; called once, also after a failure."""


# ---------------------------------------------------------------------------------------------- multi-turn
@dataclass(frozen=True)
class Turn:
    """One sampled turn of an episode, as the environment sees it."""

    text: str  # the turn's sampled text, special tokens removed
    ids: list[int]  # its sampled token ids exactly as the engine returned them
    index: int  # 1-based turn number
    eos: bool  # it ended with an end-of-sequence token
    exhausted: bool  # it ran into the episode's response budget without a stop: nothing more can be sampled


@dataclass
class Step:
    """What an environment answers a turn with: an observation to append (text, tokenized on its own, or token
    ids used as they are; masked out of every loss term), or the end of the episode."""

    observation: str | list[int] | None = None
    done: bool = False
    counts: dict[str, float] = field(default_factory=dict)  # added to the episode's Environment.episode_counts


class Environment(Task):
    """A multi-turn task. Per episode: `reset(example)` gives the state; after each sampled turn `step(state,
    turn)` returns a Step. A turn ends at one of the `stop` strings (kept in its tokens), at EOS or at its
    token cap; the engine ends the episode at multiturn.max_turns or its token budget. Override `step_batch`
    to serve all live episodes of a turn at once (one retrieval call for the batch)."""

    stop: tuple[str, ...] = ()  # strings that end a turn besides EOS (multiturn.stop, when set, replaces them)
    episode_counts: tuple[str, ...] = ()  # per-episode counters of Step.counts, in samples and the metrics

    def problem_key(self, example: Example) -> Hashable:
        """The question and the reference: an environment's hidden state (the reference) can make one prompt
        text several problems."""
        return (example.question, example.reference)

    def reset(self, example: Example) -> Any:
        return None

    def step(self, state: Any, turn: Turn) -> Step:
        raise NotImplementedError(f"{type(self).__name__} defines neither step() nor step_batch()")

    def step_batch(self, states: list[Any], turns: list[Turn], stats: Any) -> list[Step]:
        """Steps for the live episodes of one turn; `stats` is this generate call's `call_stats()` object."""
        return [self.step(s, t) for s, t in zip(states, turns, strict=True)]

    def call_stats(self) -> Any:
        """A fresh accumulator for one generate call's resource counters (None: none); its `measure(meter)` writes
        them into the step's meter (base/meter.py) under their logged names: meter.add for counts, meter.max for
        the slowest rank's (latencies). The names must not depend on the batch (every rank meters the same)."""
        return None

    def episode_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """rollout/* metrics from the step's sums over every rank's episodes: 'n' (episodes), 'turns', and each
        of episode_counts. Default: rollout/<count>_mean per episode."""
        n = max(sums["n"], 1.0)
        return {f"rollout/{k}_mean": sums[k] / n for k in self.episode_counts}


# ------------------------------------------------------------------------------------------------- voting
def exact_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by the stripped completion; empty = no answer (None)."""
    ids: dict[str, int] = {}
    out: list[int | None] = []
    for c in completions:
        key = c.strip()
        out.append(ids.setdefault(key, len(ids)) if key else None)
    return out


# ------------------------------------------------------------------------------------------ safe scoring
class RewardTimeout(Exception):
    pass


ALARM_REPEAT_S = 0.05


@contextmanager
def time_limit(seconds: float):
    """SIGALRM-based limit (Unix, main thread). Elsewhere the limit cannot be enforced and is skipped. The alarm
    repeats every ALARM_REPEAT_S past the limit: a grader that catches Exception around each stage of its work
    (math-verify's parse and verify do) swallows one RewardTimeout per stage, and each later stage is cut short
    too instead of running to its end."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum, frame):
        raise RewardTimeout

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_NO_RESULT = object()


def guarded(fn: Callable, timeout_s: float, default):
    """fn() under the time limit; `default` if it times out or raises (math-verify on odd input)."""
    try:
        return _within(fn, timeout_s)
    except RewardTimeout:
        return default
    except Exception:  # noqa: BLE001 -- same policy as score_completions: a grader failure scores, never stops
        return default


def _within(fn: Callable, timeout_s: float):
    """fn() under time_limit, and RewardTimeout also when it returns past the limit: a callee that catches every
    Exception swallows the alarm's RewardTimeout and returns a made-up result (math-verify's parse and verify do:
    parse then returns its raw-string fallback), which must count as the timeout it was."""
    t0 = time.monotonic()
    with time_limit(timeout_s):
        out = fn()
    if time.monotonic() - t0 >= timeout_s:
        raise RewardTimeout
    return out


def finite_reward(out) -> float | None:
    """A grader's return value as a finite float; None when it is not one (scored 0 and counted invalid): text
    (even '1.0': a grader that returns text is broken), an int past float's range (10**400), a value whose
    float() raises."""
    if isinstance(out, str | bytes | bytearray):
        return None
    try:
        r = float(out)
    except Exception:  # noqa: BLE001 -- __float__ may be a user's: OverflowError, ArithmeticError, anything
        return None
    return r if math.isfinite(r) else None


def score_completions(task: Task, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
    """Grade completions[i] against examples[i] with `task.grade`, checked. Never raises for what a grader does:
    a raising batch scores 0 (counted as errors); rewards that are not finite numbers score 0 (counted invalid);
    `correct` is reward >= task.correct_threshold; parts and counts carry exactly the task's names. A batch
    grader's own time limits are its business (a sandbox enforces per-program deadlines): no alarm wraps it."""
    n = len(completions)
    if n != len(examples):
        raise ValueError(f"score_completions: {n} completions for {len(examples)} examples")
    try:
        s = task.grade(completions, examples, timeout_s)
        # Lists of the wrong length, or parts, counts or format flags that are no numbers or truth values, are the
        # grader's failure like an exception it raises (float(10**400) raises too). Rewards are checked one by one.
        if not (len(s.rewards) == len(s.formatted) == n):
            raise ValueError(f"grade returned {len(s.rewards)} rewards, {len(s.formatted)} format flags for {n}")
        parts = {k: [float(x) for x in s.parts.get(k, [0.0] * n)] for k in task.part_names}
        if any(len(v) != n for v in parts.values()):
            raise ValueError(f"grade returned parts of lengths {[len(v) for v in parts.values()]} for {n}")
        counts = {k: float(s.counts.get(k, 0.0)) for k in task.count_names}
        formatted = [bool(f) for f in s.formatted]
        errors, timeouts, invalid = int(s.errors), int(s.timeouts), int(s.invalid)
        checked = [finite_reward(out) for out in s.rewards]
    except Exception:  # noqa: BLE001 -- like a per-completion reward: a grader failure scores 0, never stops
        return Scores(
            [0.0] * n,
            [False] * n,
            [False] * n,
            errors=n,
            parts={k: [0.0] * n for k in task.part_names},
            counts=dict.fromkeys(task.count_names, 0.0),
        )
    rewards, invalid = [r or 0.0 for r in checked], invalid + sum(r is None for r in checked)
    correct = [r >= task.correct_threshold for r in rewards]
    return Scores(rewards, correct, formatted, errors, timeouts, invalid, parts, counts)
