"""The synthetic verifiable task the tiny model learns on CPU (the demo's): reverse a short lowercase string.

Question "abcde", answer "edcba"; `reverse_reward` gives dense partial credit: matching positions /
max(len(pred), len(ref)), so 1.0 only for the exact reversal. Train and held-out splits are disjoint sets of
strings drawn from a fixed seed: the task's own splits 'task:train' and 'task:heldout' (data.train / data.eval's
defaults), or the same records as files:

    python scripts/make_synthetic_data.py --out data/reverse
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rl_training.data.sources import DataError, Example
from rl_training.tasks.base import Task

SPLIT_SIZES = {"train": 4000, "heldout": 256}  # the task's own splits, drawn with seed 0 (write_reverse_data's)


def make_reverse_splits(
    n_train: int, n_heldout: int, seed: int = 0, alphabet: str = "abcdefghij", min_len: int = 3, max_len: int = 7
) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    strings: list[str] = []
    while len(strings) < n_train + n_heldout:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if s not in seen:
            seen.add(s)
            strings.append(s)
    recs = [{"question": s, "answer": s[::-1]} for s in strings]
    return recs[:n_train], recs[n_train:]


def write_reverse_data(
    out: str | Path, n_train: int = SPLIT_SIZES["train"], n_heldout: int = SPLIT_SIZES["heldout"], seed: int = 0
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = make_reverse_splits(n_train, n_heldout, seed)
    for name, recs in (("train", train), ("heldout", heldout)):
        tmp = out / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(out / f"{name}.jsonl")
    return out


def reverse_reward(completion: str, reference: str) -> float:
    pred = completion.strip()
    if not pred and not reference:
        return 1.0
    same = sum(a == b for a, b in zip(pred, reference, strict=False))
    return same / max(len(pred), len(reference))


def reverse_has_answer(completion: str) -> bool:
    pred = completion.strip()
    return bool(pred) and pred.isalpha()


class ReverseTask(Task):
    """{question_key: "abcd", answer_key: "dcba"} records; partial credit per position (module docstring)."""

    reward_range = (0.0, 1.0)
    prompt_template = "{question}="  # 'abcd=' -> 'dcba': the tiny model's format, no words

    def __init__(self, question_key: str = "question", answer_key: str = "answer"):
        self.question_key, self.answer_key = question_key, answer_key

    def examples(self, split: str) -> list[Example]:
        """The split 'task:train' or 'task:heldout': the records write_reverse_data writes, in their order."""
        if split not in SPLIT_SIZES:
            raise DataError(f"data spec 'task:{split}': the reverse task makes the splits {', '.join(SPLIT_SIZES)}")
        recs = make_reverse_splits(SPLIT_SIZES["train"], SPLIT_SIZES["heldout"])[list(SPLIT_SIZES).index(split)]
        return [Example(r["question"], r["answer"], r["answer"], f"task:{split}:{i}") for i, r in enumerate(recs, 1)]

    def reward(self, completion: str, example: Example) -> float:
        return reverse_reward(completion, example.reference)

    def has_answer(self, completion: str) -> bool:
        return reverse_has_answer(completion)
