"""pass@k and maj@k by their definitions, enumerating every k-subset (what the closed forms are tested against)."""

import itertools


def pass_by_enumeration(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def maj_by_enumeration(classes: list, correct: list[bool], k: int) -> float:
    """The definition, literally: every k-subset votes; ties split evenly; no votes = wrong."""
    total, subsets = 0.0, list(itertools.combinations(range(len(classes)), k))
    for s in subsets:
        votes: dict = {}
        for i in s:
            if classes[i] is not None:
                votes.setdefault(classes[i], []).append(correct[i])
        if votes:
            top = max(map(len, votes.values()))
            winners = [v for v in votes.values() if len(v) == top]
            total += sum(sum(v) / len(v) for v in winners) / len(winners)
    return total / len(subsets)
