"""A search task the tiny CPU model can learn: facts reachable only through the retriever.

Every key (a random pronounceable word, 3 syllables by default: 'bazoki') has one corpus passage with a
random 3-digit code:
- 1 hop: 'bazoki\ncode=417'; the question 'code of bazoki?' -> '417' (one search: bazoki);
- 2 hops: 'bazoki\nbazoki code=417; friend kelumo.' with a friend (another key of the same split); the question
  'code of friend of bazoki?' -> kelumo's code (two searches: bazoki, then kelumo).
Keys are split into training and held-out pools before anything else, and friends stay inside their pool,
so a held-out question never touches a key (or a code) that a training question does: its code can only
come from the retriever. With 2 hops the key appears twice in its own passage and once in its friend's, so
BM25 ranks a key's own passage first (tested for every key).

Why 20,000 training keys: with a few hundred, SFT on the gold episodes sees each key dozens of times and the
tiny model memorises the training codes, which never transfers to a held-out key; the copy out of the
observation, which does, was then learned late or not at all (held-out EM 0.05 after 450 steps with 400 keys).
With 20,000 each key is seen under once in a short SFT, so memorising cannot lower the loss.

Why each observation is followed by a note in `<think>` ('<think>code=417</think><answer>417</answer>'): the
note repeats the passage's own words, so copying the digits into it is a plain induction (after '=', what
followed '=' before), and the answer then copies from a few tokens back. '=' rather than a space: with it the
copy was learned for more data orders on one machine (docs/search.md, the CPU demo, has the table). Answering
straight from the observation needs the model to locate the code first; the tiny model learned that abruptly,
at a step that depended on the data order (400 to over 900 steps); with the note, at ~250-300 steps
(docs/search.md, the CPU demo, has the measurements). Search-R1's prompt asks for the same: reasoning in
`<think>` after new information.

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

from rl_training.retrieval.bm25 import BM25Retriever
from rl_training.retrieval.retriever import Passage, information_block

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
TEMPLATE = "{question}\n"  # the prompt of the gold episodes; use the same as data.prompt_template
RESERVED = {"code", "friend"}  # passage words that must not be keys
NO_ANSWER = "unknown"  # the answer of the mix's gold episodes that do not search (write_search_data)


@dataclass(frozen=True)
class Fact:
    key: str
    code: str
    friend: str


def make_keys(n: int, rng: random.Random, syllables: int = 3, taken: frozenset[str] = frozenset()) -> list[str]:
    """`n` distinct keys of `syllables` consonant-vowel pairs (3: 'bazoki'), none a stopword, a passage word or
    one of `taken`."""
    from bm25s.stopwords import STOPWORDS_EN

    banned = set(STOPWORDS_EN) | RESERVED | taken
    out: dict[str, None] = {}
    if n + len(taken) > (len(CONSONANTS) * len(VOWELS)) ** syllables // 2:
        raise ValueError(f"{n} keys: too many for {2 * syllables}-letter words")
    while len(out) < n:
        k = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(syllables))
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
        return Passage(str(pid), f"{f.key}\ncode={f.code}")
    return Passage(str(pid), f"{f.key}\n{f.key} code={f.code}; friend {f.friend}.")


def question(f: Fact, facts: dict[str, Fact], hops: int) -> tuple[str, str, list[str], list[str]]:
    """(question, answer, search queries of a successful episode, the note it makes after each search)."""
    if hops == 1:
        return f"code of {f.key}?", f.code, [f.key], [f"code={f.code}"]
    friend = facts[f.friend]
    return f"code of friend of {f.key}?", friend.code, [f.key, f.friend], [f"friend {f.friend}", f"code={friend.code}"]


def gold_episode(
    q: str,
    answer: str,
    queries: list[str],
    observations: list[str],
    notes: list[str],
    template: str = TEMPLATE,
    reply: str = "",
) -> dict:
    """A gold episode: each query's search and its observation (the `information_block` the engine appends),
    each observation followed by a note of what it said in `<think>` (Search-R1's reasoning tag), then the
    answer. `queries=[]` and `reply` make one that answers `reply` without searching."""
    segments, note = [], ""
    for query, obs, after in zip(queries, observations, notes, strict=True):
        segments.append({"text": f"{note}<search>{query}</search>", "trainable": True})
        segments.append({"text": obs, "trainable": False})
        note = f"<think>{after}</think>"
    segments.append({"text": f"{note}<answer>{reply or answer}</answer>", "trainable": True})
    return {
        "question": q,
        "prompt": template.replace("{question}", q),
        "segments": segments,
        "golden_answers": [answer],
    }


def write_search_data(
    out: str | Path,
    *,
    n_train_keys: int = 20000,
    n_heldout_keys: int = 100,
    hops: int = 1,
    topk: int = 3,
    seed: int = 0,
    template: str = TEMPLATE,
    search_frac: float | None = None,
    syllables: int = 3,
    n_valid_keys: int = 0,
) -> Path:
    """Write corpus.jsonl, train.jsonl, heldout.jsonl (Search-R1's plain jsonl form: question,
    golden_answers, data_source) and gold_train.jsonl / gold_heldout.jsonl (gold episodes) into `out`.

    With `search_frac`, also gold_train_mix.jsonl: the training gold episodes of which only that fraction
    (drawn at random) search, the others answering `<answer>unknown</answer>` at once: a model tuned on it
    can search and read but seldom reaches for the tool (the demo's start, docs/search.md).

    With `n_valid_keys`, also valid.jsonl: questions about that many more keys, drawn from a generator of their
    own (the other files' keys and facts are the same with or without them; their passages join the corpus):
    what a warm start's skill gate checks, never the reported held-out set."""
    if hops not in (1, 2):
        raise ValueError(f"hops must be 1 or 2, got {hops}")
    if search_frac is not None and not 0.0 <= search_frac <= 1.0:
        raise ValueError(f"search_frac must be in [0, 1], got {search_frac}")
    rng = random.Random(seed)
    keys = make_keys(n_train_keys + n_heldout_keys, rng, syllables)
    pools = {"train": keys[:n_train_keys], "heldout": keys[n_train_keys:]}
    facts = {k: f for pool in pools.values() for k, f in make_facts(pool, rng).items()}
    if n_valid_keys:
        own = random.Random(seed + 2)
        pools["valid"] = make_keys(n_valid_keys, own, syllables, taken=frozenset(keys))
        facts |= make_facts(pools["valid"], own)
        keys = keys + pools["valid"]
    corpus = [passage(facts[k], i, hops) for i, k in enumerate(keys)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "corpus.jsonl", [{"id": p.id, "contents": p.contents} for p in corpus])
    retriever = BM25Retriever(corpus)
    for split, pool in pools.items():
        asked = [question(facts[k], facts, hops) for k in pool]
        res = retriever.retrieve([query for _, _, queries, _ in asked for query in queries], topk)  # one call
        obs = iter(information_block(p, e) for p, e in zip(res.passages, res.errors, strict=True))
        rows = [{"question": q, "golden_answers": [a], "data_source": f"synthetic_{hops}hop"} for q, a, *_ in asked]
        gold = [gold_episode(q, a, qs, [next(obs) for _ in qs], notes, template) for q, a, qs, notes in asked]
        _write_jsonl(out / f"{split}.jsonl", rows)
        if split != "valid":
            _write_jsonl(out / f"gold_{split}.jsonl", gold)
        if split == "train" and search_frac is not None:
            mix = random.Random(seed + 1)
            unsearched = (gold_episode(q, a, [], [], [], template, reply=NO_ANSWER) for q, a, *_ in asked)
            _write_jsonl(
                out / "gold_train_mix.jsonl", [g if mix.random() < search_frac else u for g, u in zip(gold, unsearched)]
            )
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
