"""The synthetic verifiable task the tiny model learns on CPU: reverse a short lowercase string.

Question "abcde", answer "edcba"; the reward (rewards.reverse_reward) gives dense partial credit per
matching position. Train and held-out splits are disjoint sets of strings drawn from a fixed seed.

    python scripts/make_synthetic_data.py --out data/reverse
"""

from __future__ import annotations

import json
import random
from pathlib import Path


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


def write_reverse_data(out: str | Path, n_train: int = 4000, n_heldout: int = 256, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = make_reverse_splits(n_train, n_heldout, seed)
    for name, recs in (("train", train), ("heldout", heldout)):
        tmp = out / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(out / f"{name}.jsonl")
    return out
