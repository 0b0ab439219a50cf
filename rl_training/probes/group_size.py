"""rollout.group_size_auto: the step's split of its completion budget, N = B K, follows the rollout-budget
advisor (issue 52, item 3; docs/probes.md 10.9).

At a checkpoint boundary, where the advisor is trusted and the current K lies outside the band of its K*
(probe/advisor/k_lo .. k_hi, from the ±2 SE band of tr S_w / tr S_b: the alert's test of "far"), K becomes
K* rounded and clipped to [group_size_min, group_size_max], and B the most prompts with B K <= N that the ranks
and micro-batches divide (`prompts_for`). Inside the band K stays: the estimate cannot tell it from K*, and a
split that moved with the noise would only restart the probes' GNS windows (a group of another size is another
unit). The new split starts at the boundary's step, so the checkpoint written there holds it: the sampler's
schedule (data/prompts.py PromptSampler.segments) and the advice it came from are trainer state, and a resumed
run trains the same splits at the same steps.

What the advisor assumes carries over a switch: tr S_b and tr S_w are per prompt and per completion, the waste
curve w(k) is per prompt for every k, the costs are per prompt and per completion (probes/budget.py). So its
EMAs continue, and only the GNS (in groups) restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADVICE_KEYS = ("probe/advisor/k_star", "probe/advisor/k_lo", "probe/advisor/k_hi", "probe/advisor/trusted")


def prompts_for(budget: int, k: int, multiple: int, n_prompts: int, least: int = 0) -> int:
    """B for K: the most prompts with B K <= `budget` that is a multiple of `multiple` (world size x
    train.micro_batch_groups) and at most the dataset's `n_prompts`; at least `least` (default `multiple`)."""
    b = min(budget // k, n_prompts) // multiple * multiple
    return max(b, least or multiple)


def choose_k(advice: dict[str, float], current: int, k_min: int, k_max: int) -> int | None:
    """The group size to switch to, or None to keep `current`: K* rounded to the nearest integer and clipped
    to [k_min, k_max] when the advice is trusted and `current` lies outside its band (clipped the same way)."""
    k_star, lo, hi = (advice.get(k, math.nan) for k in ADVICE_KEYS[:3])
    if not advice.get("probe/advisor/trusted") or not all(map(math.isfinite, (k_star, lo, hi))):
        return None

    def clip(k: float) -> int:
        return min(max(math.floor(k + 0.5), k_min), k_max)

    if clip(lo) <= current <= clip(hi):
        return None
    k = clip(k_star)
    return None if k == current else k


@dataclass
class GroupSizeAuto:
    """The runner's side of rollout.group_size_auto: the last advice seen, and the switch at a boundary."""

    budget: int  # N: completions per step, summed over ranks (rollout.prompts_per_step x rollout.group_size)
    k_min: int
    k_max: int
    multiple: int  # B's multiple: world size x train.micro_batch_groups
    n_prompts: int  # the dataset's: B is at most this
    least: int  # the fewest prompts a step may have
    advice: dict | None = None  # the newest step's advisor metrics (ADVICE_KEYS), measured every probe.unit_every

    @classmethod
    def from_config(cls, cfg, world_size: int, n_prompts: int, state: dict | None) -> GroupSizeAuto | None:
        r = cfg.rollout
        if not r.group_size_auto:
            return None
        budget, multiple = r.prompts_per_step * r.group_size, world_size * cfg.train.micro_batch_groups
        # On one rank, two micro-batches at least: the GNS micro level needs two small batches per step.
        least = multiple * (2 if world_size == 1 else 1)
        return cls(
            budget=budget,
            k_min=r.group_size_min,
            k_max=min(r.group_size_max or 2 * r.group_size, max(budget // least, r.group_size_min)),
            multiple=multiple,
            n_prompts=n_prompts,
            least=least,
            advice=(state or {}).get("advice"),
        )

    def observe(self, metrics: dict[str, float]) -> None:
        """Keep a step's advice (the advisor reports on the steps the unit level measures)."""
        if ADVICE_KEYS[0] in metrics:
            self.advice = {k: float(metrics[k]) for k in ADVICE_KEYS}

    def decide(self, current: int) -> tuple[int, int] | None:
        """(B, K) to switch to at this boundary, or None."""
        k = choose_k(self.advice or {}, current, self.k_min, self.k_max)
        return None if k is None else (prompts_for(self.budget, k, self.multiple, self.n_prompts, self.least), k)

    def state_dict(self, segments) -> dict:
        return {"segments": [list(s) for s in segments], "advice": self.advice}


def segments_of(state: dict | None) -> tuple[tuple[int, int, int], ...]:
    """The sampler's schedule from a checkpoint's trainer state "group_size_auto" (none: the configured split)."""
    return tuple(tuple(s) for s in (state or {}).get("segments", ()))
