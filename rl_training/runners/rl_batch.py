"""A step's batch on this rank: its prompts generated (generate_step: what the async producer runs), graded
(score_batch), refilled where its groups tie (refill_step: rollout.dynamic_sampling, rollout/refill.py) and shaped
(shaped_rewards). rl_runner.rl_step calls them in that order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rl_training.algs.shaping import overlong_penalty
from rl_training.base.meter import Meter
from rl_training.base.timer import PhaseTimer
from rl_training.rollout.base import SamplingSpec, StepBatch
from rl_training.rollout.refill import RefillStats, Scored, refill
from rl_training.tasks.base import score_completions

if TYPE_CHECKING:
    from rl_training.runners.rl_runner import Run


def generate_step(run: Run, step: int, refill_round: int = 0, n_prompts: int = 0) -> StepBatch:
    """This rank's prompts of step `step` and their G completions each: the one call that makes a step's batch.
    With rollout.max_async_level > 0 the producer thread runs it, so it calls no collective. `refill_round` > 0:
    `n_prompts` more prompts for that round of dynamic sampling (rollout/refill.py), with their own seeds."""
    cfg, G = run.cfg, run.cfg.rollout.group_size
    if refill_round:
        idx = run.sampler.refill_indices(step, run.info.rank, refill_round, n_prompts)
    else:
        idx = run.sampler.indices(step, run.info.rank)
    spec = SamplingSpec(
        n=G,
        max_new_tokens=cfg.rollout.max_new_tokens,
        min_new_tokens=cfg.rollout.min_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        seed=sampling_seed(cfg.train.seed, run.info.rank, step, refill_round),
    )
    examples = [run.examples[i] for i in idx]
    rollouts = run.backend.generate([run.prompts[i] for i in idx], spec, examples=examples)
    return StepBatch(idx, rollouts, G, [ex for ex in examples for _ in range(G)])


def score_batch(run: Run, batch: StepBatch) -> Scored:
    """The task's grades of a batch (`rewards`: the task's, before any shaping)."""
    scores = score_completions(run.task, batch.rollouts.texts, batch.examples, run.cfg.reward.timeout_s)
    return Scored(batch, scores, scores.rewards)


def refill_step(run: Run, step: int, first: Scored, meter: Meter, timer: PhaseTimer) -> tuple[Scored, RefillStats]:
    """rollout.dynamic_sampling: the step's groups with tied rewards replaced by informative groups of newly drawn
    prompts (rollout/refill.py). The refills sample the newest weights (in async mode too: the main thread is not
    pinned to an old version); their generation and scoring time go to the step's generate and score phases."""

    def draw(round_: int, n: int) -> Scored:
        with timer("generate"):
            batch = generate_step(run, step, round_, n)
        with timer("score"):
            return score_batch(run, batch)

    out, stats = refill(first, draw, run.cfg.rollout.dynamic_sampling_max_rounds)
    stats.measure(meter, out.batch.groups)
    return out, stats


def shaped_rewards(run: Run, meter: Meter, ro, rewards: list[float]) -> list[float]:
    """The rewards the learner trains on: the task's minus DAPO's soft overlong penalty (reward.overlong_buffer;
    algs/shaping.py) over the response budget, metered when on (rollout/reward_mean stays the task's reward)."""
    r = run.cfg.reward
    if not r.overlong_buffer:
        return rewards
    lengths = [ro.trainable(i) for i in range(len(ro))]
    pen = overlong_penalty(lengths, run.learner.max_trainable_tokens, r.overlong_buffer, r.overlong_penalty)
    meter.mean("reward/overlong_penalty_mean", sum(pen), per=len(pen))
    meter.mean("reward/overlong_penalized_frac", sum(p > 0 for p in pen), per=len(pen))
    return [x - p for x, p in zip(rewards, pen, strict=True)]


def sampling_seed(seed: int, rank: int, step: int, refill_round: int = 0) -> int:
    """A sampling seed that is a pure function of (seed, rank, step[, refill round]), so a resumed run samples the
    same; round 0 (the step's own batch) keeps the seeds every run before dynamic sampling had."""
    key = [seed, rank, step, refill_round] if refill_round else [seed, rank, step]
    return int(np.random.SeedSequence(key).generate_state(1)[0] % 2**31)
