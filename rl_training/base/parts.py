"""The metrics contract of a step: every producer returns a Part, and `assemble` reduces them all at once.

A Part is this rank's share of one producer's metrics:
  sums   added over ranks (counts, token sums, loss sums),
  maxes  the largest over ranks (a maximum, the slowest rank's phase time),
  finish (sums, maxes, logged so far) -> the producer's metrics, from the global values (a mean is a sum over a
         count, never a mean of per-rank means); it may read what the producers before it logged (the weight
         guard reads the step's canary); None logs the sums and maxes as they are,
  ready  values that need no reduction: already agreed over ranks (the skip counters, the probes' own reductions)
         or one engine's own (a backend's weight version), logged as rank 0 has them.
`assemble` runs one sum all-reduce and one max all-reduce for every Part of the step (keys prefixed by the
Part's position, so two producers may use the same short names), then each finish in order: a new step metric
is one line in its producer's Part. Every rank calls it with the same Parts (same keys), or the collectives
would not line up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rl_training.base import dist

Finish = Callable[[dict[str, float], dict[str, float], dict[str, float]], dict[str, float]]


@dataclass
class Part:
    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    finish: Finish | None = None
    ready: dict[str, float] = field(default_factory=dict)


def assemble(parts: Sequence[Part], device) -> dict[str, float]:
    """Collective (every rank, the same Parts): the step's metrics, in the Parts' order."""
    local_sums = {f"{i}.{k}": v for i, p in enumerate(parts) for k, v in p.sums.items()}
    local_maxes = {f"{i}.{k}": v for i, p in enumerate(parts) for k, v in p.maxes.items()}
    sums = dist.reduce_sums(local_sums, device) if local_sums else {}
    maxes = dist.reduce_max(local_maxes, device) if local_maxes else {}
    out: dict[str, float] = {}
    for i, p in enumerate(parts):
        s = {k: sums[f"{i}.{k}"] for k in p.sums}
        m = {k: maxes[f"{i}.{k}"] for k in p.maxes}
        out.update(p.finish(s, m, out) if p.finish is not None else {**s, **m})
        out.update(p.ready)
    return out
