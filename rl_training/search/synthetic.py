"""A search task the tiny CPU model can learn: facts reachable only through the retriever.

Every key (a random pronounceable 4-letter word) has one corpus passage with a random 3-digit code:
- 1 hop: 'bazo\\ncode 417'; the question 'code of bazo?' -> '417' (one search: bazo);
- 2 hops: 'bazo\\nbazo code 417; friend kelu.' with a friend (another key of the same split); the question
  'code of friend of bazo?' -> kelu's code (two searches: bazo, then kelu).
Keys are split into training and held-out pools before anything else, and friends stay inside their pool,
so a held-out question never touches a key (or a code) that a training question does: its code can only
come from the retriever. With 2 hops the key appears twice in its own passage and once in its friend's, so
BM25 ranks a key's own passage first (tested for every key).

Why the 1-hop passage is that short: the answer's digits must be copied out of the observation, and the
tiny model learned that copy only with the short passage (SFT on gold episodes, batch 32, lr 3e-3, measured
in docs/search.md): with 'bazo\\nbazo code 417; friend kelu.' (a 77-character observation) or the same with the
code last ('... friend kelu; code 417.', about as near to `<answer>` as now), held-out EM was still 0 after 400
steps, the digits' loss at chance (2.3 nats); with 'bazo\\ncode 417' (58 characters) it was 0.10 after 300
steps and 0.27 after 400. One seed each, so a pointer rather than a law: the passage's length (the key and
friend letters around the code) mattered, the code's distance to `<answer>` alone did not.

Gold episodes are the exact text of a successful episode, in segments marked trainable (what the policy
samples) or not (the observation the engine appends), the observations produced by the same BM25 retriever
and `information_block` the episode engine uses: SFT trains on them with the observations masked.
Every character is ASCII, which the tiny model's byte-level vocabulary covers one token per character.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from rl_training.search.bm25 import BM25Retriever
from rl_training.search.retriever import Passage, information_block

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
TEMPLATE = "{question}\n"  # the prompt of the gold episodes; use the same as data.prompt_template
RESERVED = {"code", "friend"}  # passage words that must not be keys


@dataclass(frozen=True)
class Fact:
    key: str
    code: str
    friend: str


def make_keys(n: int, rng: random.Random) -> list[str]:
    from bm25s.stopwords import STOPWORDS_EN

    banned = set(STOPWORDS_EN) | RESERVED
    out: dict[str, None] = {}
    if n > (len(CONSONANTS) * len(VOWELS)) ** 2 // 2:
        raise ValueError(f"{n} keys: too many for 4-letter words")
    while len(out) < n:
        k = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(2))
        if k not in banned:
            out[k] = None
    return list(out)


def make_facts(keys: list[str], rng: random.Random) -> dict[str, Fact]:
    """Codes at random; friends a random derangement of `keys` (nobody is their own friend)."""
    if len(keys) < 2:
        raise ValueError("a pool needs at least 2 keys (nobody is their own friend)")
    order = list(range(len(keys)))
    rng.shuffle(order)
    shuffled = [keys[i] for i in order]  # friend of shuffled[i] = shuffled[i + 1]: one cycle, no fixed point
    friends = dict(zip(shuffled, shuffled[1:] + shuffled[:1], strict=True))
    return {k: Fact(k, f"{rng.randrange(1000):03d}", friends[k]) for k in keys}


def passage(f: Fact, pid: int, hops: int) -> Passage:
    if hops == 1:
        return Passage(str(pid), f"{f.key}\ncode {f.code}")
    return Passage(str(pid), f"{f.key}\n{f.key} code {f.code}; friend {f.friend}.")


def question(f: Fact, facts: dict[str, Fact], hops: int) -> tuple[str, str, list[str]]:
    """(question, answer, search queries of a successful episode)."""
    if hops == 1:
        return f"code of {f.key}?", f.code, [f.key]
    return f"code of friend of {f.key}?", facts[f.friend].code, [f.key, f.friend]


def gold_episode(q: str, answer: str, queries: list[str], retriever, topk: int, template: str = TEMPLATE) -> dict:
    segments = []
    for query in queries:
        segments.append({"text": f"<search>{query}</search>", "trainable": True})
        res = retriever.retrieve([query], topk)
        segments.append({"text": information_block(res.passages[0], res.errors[0]), "trainable": False})
    segments.append({"text": f"<answer>{answer}</answer>", "trainable": True})
    return {
        "question": q,
        "prompt": template.replace("{question}", q),
        "segments": segments,
        "golden_answers": [answer],
    }


def write_search_data(
    out: str | Path,
    *,
    n_train_keys: int = 400,
    n_heldout_keys: int = 100,
    hops: int = 1,
    topk: int = 3,
    seed: int = 0,
    template: str = TEMPLATE,
) -> Path:
    """Write corpus.jsonl, train.jsonl, heldout.jsonl (Search-R1's plain jsonl form: question,
    golden_answers, data_source) and gold_train.jsonl / gold_heldout.jsonl (gold episodes) into `out`."""
    if hops not in (1, 2):
        raise ValueError(f"hops must be 1 or 2, got {hops}")
    rng = random.Random(seed)
    keys = make_keys(n_train_keys + n_heldout_keys, rng)
    pools = {"train": keys[:n_train_keys], "heldout": keys[n_train_keys:]}
    facts = {k: f for pool in pools.values() for k, f in make_facts(pool, rng).items()}
    corpus = [passage(facts[k], i, hops) for i, k in enumerate(keys)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "corpus.jsonl", [{"id": p.id, "contents": p.contents} for p in corpus])
    retriever = BM25Retriever(corpus)
    for split, pool in pools.items():
        rows, gold = [], []
        for k in pool:
            q, a, queries = question(facts[k], facts, hops)
            rows.append({"question": q, "golden_answers": [a], "data_source": f"synthetic_{hops}hop"})
            gold.append(gold_episode(q, a, queries, retriever, topk, template))
        _write_jsonl(out / f"{split}.jsonl", rows)
        _write_jsonl(out / f"gold_{split}.jsonl", gold)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
