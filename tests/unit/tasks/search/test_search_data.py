"""Search task data and reward: Search-R1's parquet rows and plain jsonl read into Examples with the golden
answers in meta, Search-R1's normalisation and exact/substring match on the last <answer> of the sampled
text, the task registered, and the synthetic key -> code task (disjoint keys, BM25 finds every fact, gold
episodes score 1 and fit the tiny model's vocabulary)."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_training.config.load import load_config
from rl_training.config.schema import SearchCfg
from rl_training.data.sources import DataError, Example, load_examples
from rl_training.retrieval.bm25 import BM25Retriever
from rl_training.retrieval.retriever import information_block, load_corpus
from rl_training.tasks.base import score_completions
from rl_training.tasks.build import build_task, make_task
from rl_training.tasks.search.reward import exact_match, last_answer, normalize_answer, search_reward, substring_match
from rl_training.tasks.search.synthetic import write_search_data
from rl_training.tasks.search.task import SearchTask

SEARCH, SUBEM = make_task("search"), make_task("search_subem")

# Search-R1's instruction (scripts/data_process/nq_search.py, template 'base'), as its rows carry it.
SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {q}\n"
)


def search_r1_row(i: int, q: str, golden: list[str], source: str = "nq") -> dict:
    """One row as nq_search.py's map writes it: FlashRAG's columns (id, question, golden_answers) kept, plus
    data_source, prompt, ability, reward_model.ground_truth.target and extra_info."""
    return {
        "id": f"train_{i}",
        "question": q,
        "golden_answers": golden,
        "data_source": source,
        "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT.format(q=q)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golden}},
        "extra_info": {"split": "train", "index": i},
    }


# ----------------------------------------------------------------------------------------------- reading
def test_search_r1_parquet_rows_read_as_they_are(tmp_path):
    p = tmp_path / "train.parquet"
    rows = [
        search_r1_row(0, "who wrote hamlet?", ["William Shakespeare", "Shakespeare"]),
        search_r1_row(1, "capital of france?", ["Paris"], "hotpotqa"),
    ]
    pq.write_table(pa.Table.from_pylist(rows), p)
    ex = load_examples(str(p), SEARCH.parse)
    assert ex[0] == Example("who wrote hamlet?", "William Shakespeare", "William Shakespeare", f"{p}:row 0")
    assert ex[0].meta == {"golden_answers": ["William Shakespeare", "Shakespeare"], "data_source": "nq"}
    assert ex[1].meta == {"golden_answers": ["Paris"], "data_source": "hotpotqa"}
    assert len(load_examples(str(p), SUBEM.parse, limit=1)) == 1


def test_plain_jsonl_and_bad_rows(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(
        json.dumps({"question": " q1 ", "golden_answers": ["a", 7]})
        + "\n"
        + json.dumps({"question": "q2", "answer": "b"})
        + "\n"
    )
    ex = load_examples(str(p), SEARCH.parse)
    assert [(e.question, e.reference, e.meta["golden_answers"]) for e in ex] == [
        ("q1", "a", ["a", "7"]),
        ("q2", "b", ["b"]),
    ]
    p.write_text(json.dumps({"question": "q", "golden_answers": []}) + "\n")
    with pytest.raises(DataError, match=r"q.jsonl:1: key 'golden_answers' must be a non-empty list"):
        load_examples(str(p), SEARCH.parse)
    p.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"q.jsonl:1: no golden answers"):
        load_examples(str(p), SEARCH.parse)
    p.write_text(json.dumps({"golden_answers": ["a"]}) + "\n")
    with pytest.raises(DataError, match=r"q.jsonl:1: key 'question' must be a non-empty string"):
        load_examples(str(p), SEARCH.parse)


def test_search_config_loads():
    cfg = load_config(None, ["task.name=search", "search.retriever=http", "search.url=http://n1:8000/retrieve"])
    assert (cfg.search.topk, cfg.search.timeout_s, cfg.search.retries) == (3, 10.0, 2)
    task = build_task(cfg)
    assert isinstance(task, SearchTask) and task.match == "em" and task.search_cfg.url == "http://n1:8000/retrieve"
    assert isinstance(SUBEM, SearchTask) and SUBEM.match == "subem"


# ------------------------------------------------------------------------------------------------ reward
def test_normalisation_is_search_r1s():
    # lower -> punctuation removed (no space put in its place) -> articles dropped -> whitespace collapsed
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("theatre THE a") == "theatre"  # 'the' only as a whole word
    assert normalize_answer("  U.S.A. ") == "usa"


def test_last_complete_answer_of_the_sampled_text():
    assert last_answer("<answer> a </answer> then <answer>b</answer>") == "b"
    assert last_answer("<answer>a</answer> <answer>cut off") == "a"
    assert last_answer("<answer>\nx\ny\n</answer>") == "x\ny"
    assert last_answer("no tags") is None
    # Search-R1 grades prompt + response and so needs 2 answers; we grade the sampled text: one suffices.
    assert search_reward("<answer> Beijing </answer>", ["beijing"]) == 1.0


def test_match_values():
    gold = ["William Shakespeare", "Shakespeare"]
    assert exact_match("shakespeare.", gold) and not exact_match("W. Shakespeare", gold)
    assert substring_match("W. Shakespeare", gold) and not substring_match("Marlowe", gold)
    assert search_reward("<answer>Marlowe</answer>", gold) == 0.0
    assert search_reward("<answer>Marlowe</answer>", gold, format_score=0.1) == 0.1  # answered, wrong
    assert search_reward("Marlowe", gold, format_score=0.1) == 0.0  # no answer: no format credit
    assert search_reward("<answer>W. Shakespeare</answer>", gold, "subem") == 1.0


def test_batch_scorer_uses_every_golden_answer():
    ex = [Example("q", "William Shakespeare", "", "x:1", {"golden_answers": ["William Shakespeare", "Shakespeare"]})]
    comps = ["<answer>Shakespeare</answer>", "<answer>Sir Shakespeare</answer>", "no answer"]
    s = score_completions(SEARCH, comps, ex * 3, timeout_s=5)
    # 1: equals the 2nd golden answer; 2: only a substring match; 3: no <answer> at all
    assert s.rewards == [1.0, 0.0, 0.0] and s.correct == [True, False, False]
    assert s.formatted == [True, True, False]
    assert s.parts == {"em": [1.0, 0.0, 0.0], "subem": [1.0, 1.0, 0.0], "answered": [1.0, 1.0, 0.0]}
    sub = score_completions(SUBEM, comps, ex * 3, timeout_s=5)
    assert sub.rewards == [1.0, 1.0, 0.0] and sub.correct == [True, True, False]
    # the per-sample reward grades against the whole example: every golden answer, else the reference string as
    # one answer (not its characters)
    paris = Example("q", "Paris")
    assert SEARCH.reward("<answer>the paris</answer>", paris) == 1.0
    assert SEARCH.reward("<answer>p</answer>", paris) == 0.0
    assert SEARCH.reward("<answer>Shakespeare</answer>", ex[0]) == 1.0
    assert SUBEM.reward("<answer>in Paris</answer>", paris) == 1.0
    assert SearchTask(SearchCfg(), "em", 0.1).reward("<answer>Lyon</answer>", paris) == 0.1
    assert make_task("search", {"format_score": 0.1}).reward("<answer>Lyon</answer>", paris) == 0.1
    assert SEARCH.answer_classes(["<answer>The Bard</answer>", "<answer>bard</answer>", "x"]) == [0, 0, None]


# ------------------------------------------------------------------------------------------ synthetic task
@pytest.mark.parametrize("hops", [1, 2])
def test_synthetic_task(tmp_path, hops, tiny_model):
    from transformers import AutoTokenizer

    out = write_search_data(tmp_path / "d", n_train_keys=40, n_heldout_keys=10, hops=hops, topk=3, seed=1)
    corpus = load_corpus(out / "corpus.jsonl")
    keys = [p.contents.split("\n")[0] for p in corpus]
    assert len(keys) == len(set(keys)) == 50
    train, held = (load_examples(str(out / f"{s}.jsonl"), SEARCH.parse) for s in ("train", "heldout"))
    assert (len(train), len(held)) == (40, 10)
    key_of = {p.contents.split("\n")[0]: p for p in corpus}

    def keys_used(q: str) -> set[str]:  # the question's key and, with 2 hops, its friend
        k = q.split()[-1].rstrip("?")
        return {k, key_of[k].contents.split("friend ")[1].rstrip(".")} if hops == 2 else {k}

    used = [set().union(*(keys_used(e.question) for e in split)) for split in (train, held)]
    assert not used[0] & used[1]  # held-out questions touch no training key (friends included)
    # BM25 ranks every key's own passage first
    r = BM25Retriever(corpus)
    assert [h[0].id for h in r.retrieve(keys, 3).passages] == [p.id for p in corpus]

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for split, examples in (("train", train), ("heldout", held)):
        gold = [json.loads(x) for x in (out / f"gold_{split}.jsonl").read_text().splitlines()]
        sampled = ["".join(s["text"] for s in g["segments"] if s["trainable"]) for g in gold]
        assert all("<information>" not in t for t in sampled)
        assert [t.count("<search>") for t in sampled] == [hops] * len(gold)
        assert score_completions(SEARCH, sampled, examples, 5).rewards == [1.0] * len(gold)
        for g in gold:
            obs = [s["text"] for s in g["segments"] if not s["trainable"]]
            acts = [t["text"] for t in g["segments"] if t["trainable"]]
            queries = [re.fullmatch(r"(?:<think>[^<]*</think>)?<search>(\w+)</search>", a)[1] for a in acts[:-1]]
            assert obs == [information_block(r.retrieve([q], 3).passages[0]) for q in queries]
            code = g["golden_answers"][0]
            # after each observation a note of what it said, then the next action; the last one answers
            assert acts[-1] == f"<think>code={code}</think><answer>{code}</answer>"
            if hops == 2:
                assert acts[1].startswith(f"<think>friend {queries[1]}</think>") and f"friend {queries[1]}." in obs[0]
            assert f"code={code}" in obs[-1]
            text = g["prompt"] + "".join(s["text"] for s in g["segments"])
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text) and tok.decode(ids) == text  # ASCII: one token per character
            assert len(ids) < 450  # 2 hops, topk 3: ~415; fits the tiny model's 512 positions with room for EOS


def test_synthetic_mix_searches_in_the_given_share_and_is_otherwise_the_gold(tmp_path):
    """gold_train_mix.jsonl (the demo's stage-2 warm start): the episodes that search are gold_train's own,
    the others answer 'unknown' without a search, and the share that searches is search_frac within noise:
    400 Bernoulli(0.3) draws have sd sqrt(0.3 * 0.7 / 400) = 0.023, so 0.3 +- 0.08 is 3.5 sd."""
    out = write_search_data(tmp_path / "d", n_train_keys=400, n_heldout_keys=10, topk=1, search_frac=0.3)
    gold, mix = (
        [json.loads(x) for x in (out / f).read_text().splitlines()]
        for f in ("gold_train.jsonl", "gold_train_mix.jsonl")
    )
    assert [g["question"] for g in gold] == [m["question"] for m in mix]
    searched = [m == g for g, m in zip(gold, mix, strict=True)]
    assert abs(sum(searched) / len(mix) - 0.3) < 0.08
    for g, m, s in zip(gold, mix, searched, strict=True):
        if not s:
            assert m["segments"] == [{"text": "<answer>unknown</answer>", "trainable": True}]  # no search, no note
            assert m["golden_answers"] == g["golden_answers"] and m["prompt"] == g["prompt"]
    # the same seed writes the same files; no search_frac, no mix file
    again = write_search_data(tmp_path / "e", n_train_keys=400, n_heldout_keys=10, topk=1, search_frac=0.3)
    assert (again / "gold_train_mix.jsonl").read_text() == (out / "gold_train_mix.jsonl").read_text()
    assert not (write_search_data(tmp_path / "f", n_train_keys=40, n_heldout_keys=10) / "gold_train_mix.jsonl").exists()
    with pytest.raises(ValueError, match="search_frac"):
        write_search_data(tmp_path / "g", n_train_keys=40, n_heldout_keys=10, search_frac=1.5)


def test_synthetic_keys_are_distinct_words_of_the_given_length():
    import random

    from rl_training.tasks.search.synthetic import make_keys

    keys = make_keys(20000, random.Random(0))
    assert len(set(keys)) == 20000 and {len(k) for k in keys} == {6}  # 3 consonant-vowel pairs
    assert {len(k) for k in make_keys(50, random.Random(0), syllables=2)} == {4}
    with pytest.raises(ValueError, match="too many"):
        make_keys(2451, random.Random(0), syllables=2)  # (14 * 5) ** 2 // 2 = 2450 at most
