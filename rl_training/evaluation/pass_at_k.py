"""Eval metrics as pure functions: pass@k, maj@k, and the per-checkpoint summary of per-problem records.

No I/O, no config, no torch. `summarize` takes the records exactly as they are written to the
per-problem jsonl (see rl_training/evaluation/evaluate.py), so every number can be recomputed from that file.

Definitions (n sampled completions per problem, c of them correct):
- pass@k: the probability that at least one of k samples drawn without replacement from the n is correct,
  i.e. the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374), 1 - C(n-c, k) / C(n, k), averaged
  over problems. Not "any of the first k samples".
- maj@k: the probability that the majority vote of k samples drawn without replacement from the n is
  correct, computed exactly as the average over all C(n, k) subsets. Samples vote with their final
  answer's class (`Task.answer_classes`: math-verify equivalence for math, the stripped text for the
  reversal task); samples without an answer do not vote. A tie between the top classes is broken
  uniformly at random (its expected value is used), a subset with no votes is wrong, and a class counts as
  correct in proportion to its members the grader marked correct (all or none of them, for a consistent
  grader). So maj@1 = pass@1 when every correct sample has an answer.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def maj_at_k(answer_classes: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """Exact mean over all k-subsets of the majority vote's correctness (module docstring).

    Counting, not enumeration: a class of size m wins a subset with v votes when the other classes get at
    most v each; a dynamic programme over the other classes counts the ways to pick the remaining k - v
    samples, split by how many classes tie at v (the winner then shares 1 / (1 + ties)). Classes of equal
    size are interchangeable as opponents, so the programme runs once per (winner size, v). All terms are
    positive, so float64 loses nothing to cancellation. Cost O(n^2) array operations of size n x k.
    """
    n = len(answer_classes)
    if len(correct) != n:
        raise ValueError(f"{n} answer classes but {len(correct)} correctness flags")
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got n={n} k={k}")
    size: dict[Hashable, int] = {}
    hits: dict[Hashable, int] = {}
    abstain = 0
    for cls, ok in zip(answer_classes, correct, strict=True):
        if cls is None:
            abstain += 1
        else:
            size[cls] = size.get(cls, 0) + 1
            hits[cls] = hits.get(cls, 0) + bool(ok)
    classes_of_size: dict[int, int] = {}  # size -> how many classes have it
    value_of_size: dict[int, float] = {}  # size -> summed correctness of those classes
    for cls, m in size.items():
        classes_of_size[m] = classes_of_size.get(m, 0) + 1
        value_of_size[m] = value_of_size.get(m, 0.0) + hits[cls] / m
    total = 0.0
    for m_win, value in value_of_size.items():
        if value == 0.0:
            continue
        for v in range(1, min(m_win, k) + 1):
            opponents = dict(classes_of_size)
            opponents[m_win] -= 1
            ways = _ways_others_at_most(opponents, abstain, v, k - v)  # [ties]
            share = float(np.sum(ways / np.arange(1, len(ways) + 1)))
            total += value * math.comb(m_win, v) * share
    return total / math.comb(n, k)


def _ways_others_at_most(classes_of_size: dict[int, int], abstain: int, v: int, picks: int) -> np.ndarray:
    """ways[t] = number of ways to pick `picks` samples from the other classes and the abstainers such that
    every other class gets at most v picks and exactly t of them get v."""
    n_classes = sum(classes_of_size.values())
    dp = np.zeros((n_classes + 1, picks + 1))  # dp[ties, picked]
    dp[0, 0] = 1.0
    for m, count in classes_of_size.items():
        coef = [math.comb(m, x) for x in range(min(m, v, picks) + 1)]
        for _ in range(count):
            new = np.zeros_like(dp)
            for x, w in enumerate(coef):
                if x == v:  # this class ties the winner
                    new[1:, x:] += w * dp[:-1, : picks + 1 - x]
                else:
                    new[:, x:] += w * dp[:, : picks + 1 - x]
            dp = new
    if abstain:
        new = np.zeros_like(dp)
        for x in range(min(abstain, picks) + 1):
            new[:, x:] += math.comb(abstain, x) * dp[:, : picks + 1 - x]
        dp = new
    return dp[:, picks]


# What every completion row holds (evaluation/evaluate.py); a multi-turn row adds "turns" and its counts.
COMPLETION_KEYS = ("text", "reward", "correct", "formatted", "length", "truncated", "answer_class")


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def summarize(problems: Sequence[dict], ks: Sequence[int]) -> dict[str, float]:
    """Metrics of one checkpoint from its per-problem records (the jsonl rows).

    Greedy: accuracy, reward_mean, format_rate, response_len_mean (tokens), truncation_rate. Sampled (when
    the records have samples): pass@k and maj@k for each k, and the sampled_* means over all samples.
    """
    if not problems:
        raise ValueError("no problems to summarize")
    greedy = [p["greedy"] for p in problems]
    out = {
        "accuracy": _mean([float(g["correct"]) for g in greedy]),
        "reward_mean": _mean([g["reward"] for g in greedy]),
        "format_rate": _mean([float(g["formatted"]) for g in greedy]),
        "response_len_mean": _mean([g["length"] for g in greedy]),
        "truncation_rate": _mean([float(g["truncated"]) for g in greedy]),
    }
    if "turns" in greedy[0]:  # multi-turn episodes: turns and the environment's counts (evaluate.py)
        for key in (k for k in greedy[0] if k not in COMPLETION_KEYS and k != "error"):
            out[f"{key}_mean"] = _mean([float(g[key]) for g in greedy])
        # the episodes its environment ended by raising or by a step the engine could not use (rollout/episodes.py)
        out["env_error_rate"] = _mean([float(bool(g.get("error"))) for g in greedy])
    counts = {len(p["samples"]) for p in problems}
    if counts == {0}:
        if ks:
            raise ValueError(f"pass@k for k={list(ks)} needs sampled completions; the records have none")
        return out
    if len(counts) != 1:
        raise ValueError(f"problems have different numbers of samples: {sorted(counts)}")
    (n,) = counts
    for k in ks:
        out[f"pass@{k}"] = _mean([pass_at_k(n, sum(s["correct"] for s in p["samples"]), k) for p in problems])
    for k in ks:
        out[f"maj@{k}"] = _mean(
            [
                maj_at_k([s["answer_class"] for s in p["samples"]], [s["correct"] for s in p["samples"]], k)
                for p in problems
            ]
        )
    samples = [s for p in problems for s in p["samples"]]
    out.update(
        {
            "sampled_reward_mean": _mean([s["reward"] for s in samples]),
            "sampled_format_rate": _mean([float(s["formatted"]) for s in samples]),
            "sampled_response_len_mean": _mean([s["length"] for s in samples]),
            "sampled_truncation_rate": _mean([float(s["truncated"]) for s in samples]),
        }
    )
    if "turns" in samples[0]:
        out["sampled_turns_mean"] = _mean([s["turns"] for s in samples])
    return out


def metric_names(ks: Sequence[int], sampled: bool) -> list[str]:
    """The keys `summarize` returns, in a fixed order (CSV columns, plots)."""
    names = ["accuracy", "reward_mean", "format_rate", "response_len_mean", "truncation_rate"]
    if sampled:
        names += [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks]
        names += ["sampled_reward_mean", "sampled_format_rate", "sampled_response_len_mean", "sampled_truncation_rate"]
    return names
