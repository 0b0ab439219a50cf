"""Dynamic sampling (DAPO): refill a step's groups whose rewards all tie, so the step trains on B informative groups.

A group whose K rewards are equal has zero advantage under every group baseline (Dr-GRPO, GRPO, RLOO, DAPO's) and
adds nothing to the gradient; a step that drops a third of its groups learns from two thirds of a batch. With
`rollout.dynamic_sampling: true` the runner (rl_runner.rl_step) scores the step's batch, then draws more prompts
(PromptSampler.refill_indices: a pure function of seed, step, rank and round, so a resumed run draws the same),
generates and scores their groups, and keeps informative groups until the step holds B of them, for at most
`rollout.dynamic_sampling_max_rounds` rounds. Short after the last round, the step is topped up with the batch's own
tied groups (zero gradient), so it always holds B groups of K: the shapes, the per-rank counts and the Dr-GRPO
normaliser stay what the config says.

The normaliser. Dr-GRPO divides every step's loss by the same constant c = B K L_max (algs/objectives.py StepNorm),
never by the tokens or groups present, so a step's gradient is (1/c) times the sum of its groups' gradients. A tied
group's is zero, so a standard step over N groups, of which some set I is informative, has gradient (1/(N K L)) sum_I;
the refilled step that trains on B informative groups (the same set I when |I| = B, the only groups with a
gradient) has (1/(B K L)) sum_I = (N/B) times that. In expectation over prompts, with p the chance a group is
informative, the refilled step's gradient is grad J / p: it estimates the same direction as the standard step's
(unbiased up to that scale), with B p^-1 prompts' worth of signal at B groups' training cost, and a step size that
grows as p falls. tests/unit/rollout/test_refill.py checks the identity on the real update.

What it costs is counted: rollout/refill_rounds, rollout/refill_prompts, rollout/completions_generated against
rollout/completions_trained, and rollout/informative_group_frac before the refill (the batch as drawn). The step's
other rollout/* metrics are over the groups it trained on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from rl_training.base.groups import Groups
from rl_training.rollout.base import Rollouts, StepBatch
from rl_training.tasks.base import Scores


def informative_groups(rewards: Sequence[float], groups: Groups) -> list[bool]:
    """Per group: whether its rewards differ (a tied group has zero advantage under any group baseline)."""
    return [len(set(r)) > 1 for r in groups.split(rewards)]


@dataclasses.dataclass
class Scored:
    """A step batch with its grades and the rewards the learner trains on (shaped), group by group."""

    batch: StepBatch
    scores: Scores
    rewards: list[float]


# Rollouts' fields with one entry per sequence (None when a backend leaves them out); the rest are per call
PER_ROW = ("prompt_ids", "completion_ids", "logprobs", "truncated", "texts", "policy_version", "loss_mask",
           "turn_index", "episodes")  # fmt: skip


def _pick(xs, rows):
    return None if xs is None else [xs[r] for r in rows]


def select_groups(s: Scored, groups: Sequence[int]) -> Scored:
    """The groups `groups` of `s`, in that order."""
    k, ro, sc = s.batch.group_size, s.batch.rollouts, s.scores
    rows = s.batch.groups.rows_of(groups)
    picked = dataclasses.replace(ro, **{f: _pick(getattr(ro, f), rows) for f in PER_ROW})
    scores = dataclasses.replace(
        sc,
        rewards=_pick(sc.rewards, rows),
        correct=_pick(sc.correct, rows),
        formatted=_pick(sc.formatted, rows),
        parts={name: _pick(v, rows) for name, v in sc.parts.items()},
    )
    sizes = None if s.batch.sizes is None else [s.batch.sizes[g] for g in groups]
    batch = StepBatch([s.batch.indices[g] for g in groups], picked, k, _pick(s.batch.examples, rows), sizes)
    return Scored(batch, scores, _pick(s.rewards, rows))


class AllStats:
    """Several generate calls' environment stats measured as one (Rollouts.env_stats)."""

    def __init__(self, parts: list):
        self.parts = parts

    def measure(self, meter) -> None:
        for p in self.parts:
            p.measure(meter)


def _cat(xs: list):
    return None if any(x is None for x in xs) else [v for x in xs for v in x]


def concat(parts: list[Scored], sizes: list[int] | None = None) -> Scored:
    """The groups of `parts`, one after the other (one config group size), or, with `sizes`, their rows cut into
    groups of those sizes (rollout.allocation: per_prompt joins a prompt's rounds into one group: `indices` then
    has one entry per group of `sizes`, the first of each part's that starts a group)."""
    k = parts[0].batch.group_size
    ros = [p.batch.rollouts for p in parts]
    stats = [r.env_stats for r in ros if r.env_stats is not None]
    timings = [r.timing for r in ros if r.timing]
    timing = {key: sum(t.get(key, 0.0) for t in timings) for t in timings for key in t} or ros[0].timing
    ro = Rollouts(
        **{f: _cat([getattr(r, f) for r in ros]) for f in PER_ROW},
        env_stats=None if not stats else stats[0] if len(stats) == 1 else AllStats(stats),
        timing=timing,
    )
    scs = [p.scores for p in parts]
    scores = Scores(
        rewards=_cat([s.rewards for s in scs]),
        correct=_cat([s.correct for s in scs]),
        formatted=_cat([s.formatted for s in scs]),
        errors=sum(s.errors for s in scs),
        timeouts=sum(s.timeouts for s in scs),
        invalid=sum(s.invalid for s in scs),
        parts={name: _cat([s.parts[name] for s in scs]) for name in scs[0].parts},
        counts={name: sum(s.counts.get(name, 0.0) for s in scs) for name in scs[0].counts},
    )
    indices = _cat([p.batch.indices for p in parts])
    if sizes is None and any(p.batch.sizes is not None for p in parts):
        sizes = [n for p in parts for n in p.batch.groups.sizes]
    elif sizes is not None:
        row_index = [p.batch.indices[g] for p in parts for g, n in enumerate(p.batch.groups.sizes) for _ in range(n)]
        indices = [row_index[r] for r in Groups(tuple(sizes)).starts]
    batch = StepBatch(indices, ro, k, _cat([p.batch.examples for p in parts]), sizes)
    return Scored(batch, scores, _cat([p.rewards for p in parts]))


@dataclasses.dataclass(frozen=True)
class RefillStats:
    rounds: int  # refill rounds run (0: the batch was informative enough)
    prompts: int  # prompts drawn by them
    informative_first: int  # informative groups of the batch as drawn
    informative_kept: int  # informative groups the step trains on (<= B)
    completions_generated: int  # the batch's and every refill's
    prompt_tokens_generated: int = 0  # their prompts' tokens (each prompt once) and their completions' tokens
    completion_tokens_generated: int = 0

    def measure(self, meter, trained: Groups) -> None:
        """Into `meter`, for the step that trains on the groups `trained`."""
        meter.add("rollout/refill_rounds", self.rounds)
        meter.add("rollout/refill_prompts", self.prompts)
        meter.add("rollout/completions_generated", self.completions_generated)
        meter.add("rollout/completions_trained", trained.n_rows)
        meter.mean("rollout/informative_group_frac", self.informative_first, per=len(trained))
        meter.mean("rollout/informative_group_frac_trained", self.informative_kept, per=len(trained))


def refill(first: Scored, draw: Callable[[int, int], Scored], max_rounds: int) -> tuple[Scored, RefillStats]:
    """The step's B groups: `first`'s informative groups, then those of `draw(round, n)` (n more prompts scored, for
    round 1, 2, ...) until B are informative or `max_rounds` ran; short of B, `first`'s tied groups fill the rest
    (in their order). Each round asks for as many prompts as informative groups are missing, scaled up by the
    informative fraction seen so far (at most B): a step with half its groups tied draws twice the shortfall."""
    B = len(first.batch.indices)
    info = informative_groups(first.rewards, first.batch.groups)
    kept = [select_groups(first, [g for g, ok in enumerate(info) if ok])]
    have, seen, seen_ok = sum(info), len(info), sum(info)
    rounds = prompts = 0
    generated = len(first.rewards)
    tokens = first.batch.token_counts()
    while have < B and rounds < max_rounds:
        rounds += 1
        need = B - have
        n = min(B, -(-need * seen // max(seen_ok, 1)))  # ceil(need / p), p the informative fraction so far
        more = draw(rounds, n)
        prompts += n
        generated += len(more.rewards)
        tokens = tuple(a + b for a, b in zip(tokens, more.batch.token_counts(), strict=True))
        ok = informative_groups(more.rewards, more.batch.groups)
        seen, seen_ok = seen + len(ok), seen_ok + sum(ok)
        take = [g for g, x in enumerate(ok) if x][:need]
        if take:
            kept.append(select_groups(more, take))
            have += len(take)
    if have < B:
        kept.append(select_groups(first, [g for g, ok in enumerate(info) if not ok][: B - have]))
    out = concat([p for p in kept if p.batch.indices])
    return out, RefillStats(rounds, prompts, sum(info), have, generated, *tokens)
