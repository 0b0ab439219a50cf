"""A step's batch on this rank: its prompts generated (generate_step: what the async producer runs), graded
(score_batch), refilled where its groups tie (refill_step: rollout.dynamic_sampling, rollout/refill.py) and shaped
(shaped_rewards). rl_runner.rl_step calls them in that order. The split of the step's completions into B prompts of
K: switch_split at checkpoint boundaries (rollout.group_size_auto, probes/group_size.py), apply_split after it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rl_training.algs.shaping import overlong_penalty
from rl_training.base import dist
from rl_training.base.meter import Meter
from rl_training.base.timer import PhaseTimer
from rl_training.config.schema import with_split
from rl_training.probes.budget import StepWork
from rl_training.rollout.base import Rollouts, SamplingSpec, StepBatch
from rl_training.rollout.refill import RefillStats, Scored, concat, refill, select_groups
from rl_training.tasks.base import score_completions

if TYPE_CHECKING:
    from rl_training.runners.rl_runner import Run


def switch_split(run: Run, step: int) -> None:
    """rollout.group_size_auto at a checkpoint boundary: the split (B, K) from 0-based step `step` on, where the
    trusted advisor's K* band excludes the current K (probes/group_size.py); rank 0's decision on every rank."""
    b, k = run.sampler.split(step)
    new = dist.broadcast_object(run.auto.decide(k))
    if new is None:
        return
    run.sampler = run.sampler.switched(step, *new)
    apply_split(run, step, restart=True)
    a = run.auto.advice
    dist.print0(
        f"[step {step}] rollout.group_size_auto: group size {k} -> {new[1]}, prompts per step {b} -> {new[0]} "
        f"(advisor K* {a['probe/advisor/k_star']:g}, band [{a['probe/advisor/k_lo']:g}, {a['probe/advisor/k_hi']:g}])"
    )


def apply_split(run: Run, step: int, restart: bool = False) -> None:
    """What follows the split of 0-based step `step`: the batch geometry, the normaliser's sequence count, the
    probes' units (`restart`, at a switch: the GNS starts again) and the forecast's completions per step."""
    b, k = run.sampler.split(step)
    run.derived = with_split(run.derived, b, k, run.cfg.train.micro_batch_groups)
    run.learner.seqs_per_rank = run.derived.seqs_per_rank
    run.probes.regroup(b, k, restart)
    run.forecast.per_step = b * k


def generate_step(run: Run, step: int, refill_round: int = 0, n_prompts: int = 0) -> StepBatch:
    """This rank's prompts of step `step` and their G completions each: the one call that makes a step's batch.
    With rollout.max_async_level > 0 the producer thread runs it, so it calls no collective. `refill_round` > 0:
    `n_prompts` more prompts for that round of dynamic sampling (rollout/refill.py), with their own seeds."""
    cfg, G = run.cfg, run.sampler.split(step)[1]  # rollout.group_size, or the split group_size_auto chose
    if refill_round:
        idx = run.sampler.refill_indices(step, run.info.rank, refill_round, n_prompts)
    else:
        idx = run.sampler.indices(step, run.info.rank)
    seed = sampling_seed(cfg.train.seed, run.info.rank, step, refill_round)
    if run.allocator is not None:  # rollout.allocation: per_prompt: the first round only (probes/allocation.py)
        return generate_counts(run, idx, run.allocator.first_round(idx), seed)
    examples = [run.examples[i] for i in idx]
    rollouts = run.backend.generate([run.prompts[i] for i in idx], sampling_spec(cfg, G, seed), examples=examples)
    return StepBatch(idx, rollouts, G, [ex for ex in examples for _ in range(G)])


def sampling_spec(cfg, n: int, seed: int) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(n=n, max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                        temperature=r.temperature, top_p=r.top_p, seed=seed)  # fmt: skip


def generate_counts(run: Run, idx: list[int], counts: list[int], seed: int) -> StepBatch:
    """counts[i] completions of prompt idx[i] (0: none), one group per prompt that gets any: every completion is
    its own n=1 request with its own seed (rollout/base.py completion_seeds), so groups of any size come from one
    call of any backend."""
    keep = [(i, c) for i, c in zip(idx, counts, strict=True) if c]
    examples = [run.examples[i] for i, c in keep for _ in range(c)]
    if keep:
        rows = [run.prompts[i] for i, c in keep for _ in range(c)]
        rollouts = run.backend.generate(rows, sampling_spec(run.cfg, 1, seed), examples=examples)
    else:
        rollouts = Rollouts([], [], [], [], [], policy_version=[])
    return StepBatch([i for i, _ in keep], rollouts, run.cfg.rollout.group_size, examples, [c for _, c in keep])


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


def allocate_step(run: Run, step: int, first: Scored, meter: Meter, timer: PhaseTimer) -> Scored:
    """rollout.allocation: per_prompt: the plan over the step's prompts from their history and `first` (the first
    round, probes/allocation.py), the rest generated and scored in the step's phases, each prompt's rounds joined into
    one group; then every rank's rewards go into every rank's history (a collective)."""
    idx, a = run.sampler.indices(step, run.info.rank), run.allocator
    given = a.first_round(idx)
    group_of, rewards = _groups_by_prompt(given), first.batch.groups.split(first.rewards)
    first_rewards = [rewards[g] if g is not None else [] for g in group_of]
    ks = a.plan(idx, first_rewards)
    extra = [k - g for k, g in zip(ks, given, strict=True)]  # what each prompt still needs
    seed = sampling_seed(run.cfg.train.seed, run.info.rank, step, 0, part=1)
    with timer("generate"):
        more = generate_counts(run, idx, extra, seed)
    with timer("score"):
        rest = score_batch(run, more) if len(more.rollouts) else None
    more_of = _groups_by_prompt(extra)
    parts = [select_groups(src, [g]) for p in range(len(idx)) for src, g in ((first, group_of[p]), (rest, more_of[p]))
             if g is not None]  # fmt: skip
    out = concat(parts, [k for k in ks if k])
    pairs = list(zip(out.batch.indices, out.batch.groups.split(out.rewards), strict=True))
    a.record(pair for ranks in dist.all_gather_objects(pairs) for pair in ranks)
    used = sum(1 for k in ks if k)
    meter.add("rollout/alloc_first_completions", sum(given))
    meter.add("rollout/alloc_prompts_used", used)
    meter.add("rollout/completions_generated", sum(ks))
    meter.add("rollout/completions_trained", len(out.rewards))
    meter.mean("rollout/alloc_group_size_mean", sum(ks), per=used)
    meter.max("rollout/alloc_group_size_max", max(ks))
    return out


def _groups_by_prompt(counts: list[int]) -> list[int | None]:
    """Prompt p's group number in a generate_counts batch of `counts` (None: it got no completion)."""
    out, g = [], 0
    for c in counts:
        out.append(g if c else None)
        g += bool(c)
    return out


def step_work(batch: StepBatch, timer: PhaseTimer, prompt_once: bool, drawn: RefillStats | None = None) -> StepWork:
    """What this rank's step spent so far (the rollout-budget advisor's costs, probes/budget.py); `prompt_once`: the
    backend prefills a group's prompt once (its prefix cache: rollout/kinds.py). With dynamic sampling (`drawn`) the
    generate and score phases made every drawn group, trained or not: the costs are per generated prompt and
    completion, not per trained one."""
    prompts, completions = len(batch.indices), len(batch.rollouts)
    prompt_tokens, completion_tokens = batch.token_counts()
    if drawn is not None:
        prompts, completions = prompts + drawn.prompts, drawn.completions_generated
        prompt_tokens, completion_tokens = drawn.prompt_tokens_generated, drawn.completion_tokens_generated
    return StepWork(
        seconds=dict(timer.seconds),
        prompts=prompts,
        completions=completions,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        prompt_once=prompt_once,
    )


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


def sampling_seed(seed: int, rank: int, step: int, refill_round: int = 0, part: int = 0) -> int:
    """A sampling seed that is a pure function of (seed, rank, step[, refill round][, part]), so a resumed run
    samples the same; round 0 (the step's own batch) keeps the seeds every run before dynamic sampling had. `part`
    1: per_prompt allocation's second call of the step."""
    key = [seed, rank, step, *([refill_round] if refill_round or part else []), *([part] if part else [])]
    return int(np.random.SeedSequence(key).generate_state(1)[0] % 2**31)
