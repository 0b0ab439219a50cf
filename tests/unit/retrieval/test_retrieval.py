"""The retrieval stack (rl_training/retrieval/): BM25 values against bm25s, the observation text character for
character, and the HTTP client against the real server over loopback (both request shapes, a dead server, a
slow one, a failing one), plus `python -m rl_training.retrieval.server` as a process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from rl_training.data.sources import DataError
from rl_training.retrieval.bm25 import BM25Retriever, _tokenize
from rl_training.retrieval.client import HttpRetriever, no_proxy_hosts
from rl_training.retrieval.retriever import (
    CorpusError,
    NullRetriever,
    Passage,
    RetrievalResult,
    RetrievalStats,
    format_passages,
    information_block,
    load_corpus,
)
from rl_training.retrieval.server import listen, make_app
from tests.helpers import REPO, metered

DOCS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.\nIt lies on the Spree.'},
    {"id": "2", "contents": '"Spree"\nThe Spree is a river in Germany.'},
    {"id": "3", "contents": '"Lyon"\nLyon is a city in France.'},
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return p


@pytest.fixture(scope="module")
def bm25(corpus) -> BM25Retriever:
    return BM25Retriever.from_corpus(corpus)


# ------------------------------------------------------------------------------------- formatting, corpus
def test_observation_text_is_search_r1s_exactly():
    ps = [Passage("1", '"Berlin"\nBerlin is the capital.\nOn the Spree.'), Passage("2", "Untitled")]
    # _passages2string: title = first line, text = the other lines joined by '\n', one 'Doc i(Title: ...)' each;
    # a passage without a second line has text '' (so 'Doc 2(Title: Untitled) \n').
    want = 'Doc 1(Title: "Berlin") Berlin is the capital.\nOn the Spree.\nDoc 2(Title: Untitled) \n'
    assert format_passages(ps) == want
    # the observation strips the passages' text: the final '\n' (and the space before it) go.
    assert information_block(ps) == "\n\n<information>" + want.strip() + "</information>\n\n"
    assert information_block([]) == "\n\n<information></information>\n\n"
    assert information_block([], "timed out") == "\n\n<information>Search failed: timed out</information>\n\n"


def test_corpus_errors_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": 1, "contents": "a"}\n{"id": 1, "contents": "b"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:2: duplicate id '1'"):
        load_corpus(p)
    p.write_text('{"id": 1, "text": "a"}\n')
    with pytest.raises(CorpusError, match=r'c.jsonl:1: expected an object with "id" and "contents"'):
        load_corpus(p)
    p.write_text("{oops\n")
    with pytest.raises(DataError, match=r"c.jsonl:1: invalid JSON"):  # the data loader's reader
        load_corpus(p)
    p.write_text('{"id": 7, "contents": "x"}\n\n{"id": "b", "contents": "y", "title": "ignored"}\n')
    assert load_corpus(p) == [Passage("7", "x"), Passage("b", "y")]


# -------------------------------------------------------------------------------------------------- BM25
def test_bm25_scores_equal_bm25s_and_rank_by_score(bm25):
    res = bm25.retrieve(["capital of Germany", "river Spree", "France", "zzz unknown", ""], topk=2)
    assert res.errors == [None] * 5 and res.failed == 0
    assert [p.id for p in res.passages[0]] == ["1", "0"]  # 'germany' is rarer than 'capital': Berlin first
    assert res.passages[1][0].id == "2"  # both terms in the Spree passage, one in Berlin's
    assert {p.id for p in res.passages[2]} == {"0", "3"}
    assert res.passages[3] == [] and res.passages[4] == []
    for q, hits in zip(["capital of Germany", "river Spree", "France"], res.passages[:3]):
        dense = bm25._bm25s.get_scores(_tokenize([q])[0])  # bm25s's own scoring of every document
        order = np.argsort(-dense, kind="stable")[:2]
        assert [p.id for p in hits] == [str(i) for i in order]
        np.testing.assert_allclose([p.score for p in hits], dense[order], rtol=1e-6)


def test_bm25_ties_break_by_corpus_order_and_batching_changes_nothing(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{i}", "contents": f"t{i}\nsame words here"}) + "\n" for i in range(6)))
    r = BM25Retriever.from_corpus(p)
    assert [x.id for x in r.retrieve(["same words"], 3).passages[0]] == ["d0", "d1", "d2"]
    assert [x.id for x in r.retrieve(["same words"], 10).passages[0]] == [f"d{i}" for i in range(6)]  # partition path
    qs = ["same", "t3 words", "t5", "nothing"]
    together = r.retrieve(qs, 3).passages
    assert together == [r.retrieve([q], 3).passages[0] for q in qs]


@pytest.mark.parametrize("k", [3, 12])  # k rounds of max (k <= 8), partition (k > 8)
def test_bm25_top_k_equals_bm25s_dense_scoring_on_a_random_corpus(tmp_path, k):
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    rows = [{"id": i, "contents": " ".join(rng.choices(words, k=rng.randint(5, 30)))} for i in range(400)]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = BM25Retriever.from_corpus(p)
    queries = [" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(50)]
    for q, hits in zip(queries, r.retrieve(queries, k).passages):
        dense = r._bm25s.get_scores(_tokenize([q])[0]).astype(np.float64)
        want = sorted((i for i in range(400) if dense[i] > 0), key=lambda i: (-round(dense[i], 4), i))[:k]
        assert [p.id for p in hits] == [str(i) for i in want], q
        np.testing.assert_allclose([p.score for p in hits], dense[want], rtol=1e-5)


def test_bm25_index_saved_then_loaded_only_for_its_corpus(corpus, tmp_path):
    built = BM25Retriever.from_corpus(corpus, tmp_path / "idx")
    assert (tmp_path / "idx" / "corpus.fingerprint").read_text().startswith("4:")
    loaded = BM25Retriever.from_corpus(corpus, tmp_path / "idx")
    qs = ["capital of Germany", "river Spree", "France"]
    assert loaded.retrieve(qs, 3).passages == built.retrieve(qs, 3).passages
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(d) + "\n" for d in DOCS[::-1]))  # same passages, another order
    with pytest.raises(ValueError, match="was built over another corpus; delete it to rebuild"):
        BM25Retriever.from_corpus(other, tmp_path / "idx")


def test_null_retriever_and_stats():
    res = NullRetriever().retrieve(["a", "b"], 3)
    assert res.passages == [[], []] and res.errors == [None, None]
    st = RetrievalStats()
    st.add(res)
    st.add(RetrievalResult.all_failed(3, "down", retries=4, latency_s=0.5))
    assert (st.queries, st.failed, st.retries, st.latencies_s) == (5, 3, 4, [0.0, 0.5])
    for i in range(18):
        st.add(RetrievalResult([[]], [None], latency_s=0.001 * (i + 1)))
    # 20 latencies 0, 1..18 ms, 500 ms; nearest rank: p50 = 10th smallest = 9 ms, p95 = 19th = 18 ms
    assert metered(st) == {
        "retrieval/queries": 23.0,
        "retrieval/failed": 3.0,
        "retrieval/retries": 4.0,
        "retrieval/latency_p50_ms": pytest.approx(9.0),
        "retrieval/latency_p95_ms": pytest.approx(18.0),
    }
    assert metered(RetrievalStats())["retrieval/latency_p95_ms"] == 0.0


# ------------------------------------------------------------------------------------- server and client
@contextmanager
def serve(retriever, **kw):
    """The real app under uvicorn on 127.0.0.1, an ephemeral port, in a thread; yields the /retrieve url."""
    import uvicorn

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(retriever, **kw), log_level="error"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/retrieve"
    finally:
        server.should_exit = True
        th.join(10)


class Slow:
    def __init__(self, inner, delay_s):
        self.inner, self.delay_s, self.calls, self.seen = inner, delay_s, 0, []

    def retrieve(self, queries, topk):
        self.calls += 1
        self.seen.extend(queries)  # in the order the server's threads take the requests
        time.sleep(self.delay_s)
        return self.inner.retrieve(queries, topk)


class FailsFirst:
    """Fails its first `n` calls (the server answers 500), then answers."""

    def __init__(self, inner, n):
        self.inner, self.n, self.calls = inner, n, 0

    def retrieve(self, queries, topk):
        self.calls += 1
        if self.calls <= self.n:
            return RetrievalResult.all_failed(len(queries), "index not loaded")
        return self.inner.retrieve(queries, topk)


@pytest.mark.parametrize("shape", ["batched", "single"])
def test_round_trip_over_loopback_equals_in_process(bm25, shape):
    qs = ["capital of Germany", "river Spree", "zzz", "France"]
    with serve(bm25, passages=len(bm25)) as url:
        client = HttpRetriever(url, timeout_s=10, retries=0, request_shape=shape)
        try:
            assert client.health() == {"status": "ok", "retriever": "bm25", "passages": 4}
            res = client.retrieve(qs, topk=2)
            # batched: one request; single: one per query
            assert (res.attempts, res.retries, res.failed) == ((1 if shape == "batched" else 4), 0, 0)
            assert res.passages == bm25.retrieve(qs, 2).passages  # ids, contents and scores survive JSON
            assert client.retrieve([], 2).passages == []
        finally:
            client.close()


def test_server_speaks_both_schemas_exactly(bm25):
    import requests

    with serve(bm25, default_topk=1) as url:
        s = requests.Session()
        s.trust_env = False
        batched = s.post(url, json={"queries": ["France", "Spree"], "topk": 1, "return_scores": True}).json()
        score = bm25.retrieve(["France"], 1).passages[0][0].score
        assert batched["result"][0] == [{"document": DOCS[0], "score": score}]
        assert len(batched["result"]) == 2
        single = s.post(url, json={"query": "Spree"}).json()  # SkyRL's shape; topk from the server default
        assert single == {"result": [[DOCS[2]]]}  # no scores asked: bare documents
        assert s.post(url, json={"query": "a", "queries": ["b"]}).status_code == 422
        assert s.post(url, json={"topk": 3}).status_code == 422
        assert s.post(url, json={"query": "a", "topk": 1000}).status_code == 422


def test_dead_server_fails_fast_with_counted_retries(bm25):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: connection refused
    client = HttpRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=2, retries=2, backoff_s=0.01)
    t0 = time.monotonic()
    res = client.retrieve(["a", "b"], 3)
    assert time.monotonic() - t0 < 2
    assert (res.attempts, res.retries, res.failed) == (3, 2, 2)  # 1 + 2 retries, both queries failed
    assert res.passages == [[], []]
    assert res.errors == ["connection failed (ConnectionError)"] * 2
    assert "Search failed: connection failed" in information_block([], res.errors[0])


def test_slow_server_times_out_each_attempt(bm25):
    slow = Slow(bm25, delay_s=1.0)
    with serve(slow) as url:
        client = HttpRetriever(url, timeout_s=0.2, retries=1, backoff_s=0.01, request_shape="single")
        res = client.retrieve(["France", "Spree"], 1)
    # Each attempt cut at 0.2 s: a timeout error, not the answer the server gives after 1 s.
    assert (res.attempts, res.retries, res.failed) == (4, 2, 2)
    assert res.errors == ["timed out after 0.2 s"] * 2
    # The queries concurrent: both first attempts reach the server before either retry (sent serially, the first
    # query's retry would come 0.2 s + the backoff before the second query). Server threads outlive the client's
    # timeouts (they sleep 1 s), so a peak count of concurrent calls would be 4 either way: the order tells.
    assert sorted(slow.seen[:2]) == ["France", "Spree"] and sorted(slow.seen) == ["France", "France", "Spree", "Spree"]


def test_server_errors_are_retried_then_answered(bm25):
    flaky = FailsFirst(bm25, n=2)
    with serve(flaky) as url:
        client = HttpRetriever(url, timeout_s=5, retries=2, backoff_s=0.01)
        res = client.retrieve(["France"], 1)
        assert (res.attempts, res.retries, res.failed, flaky.calls) == (3, 2, 0, 3)
        assert res.passages[0][0].id in ("0", "3")
        flaky.calls, flaky.n = 0, 5  # more failures than retries: an error result, not an exception
        res = client.retrieve(["France"], 1)
        assert (res.attempts, res.retries, res.failed) == (3, 2, 1)
        assert res.errors[0].startswith("server error 500") and "index not loaded" in res.errors[0]


def test_client_ignores_proxy_environment(bm25, monkeypatch):
    # A proxy that does not exist: a client that used it would fail to connect.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with serve(bm25) as url:
        res = HttpRetriever(url, retries=0).retrieve(["France"], 1)
    assert res.failed == 0 and res.passages[0]
    env = {"no_proxy": "a.example,localhost"}
    no_proxy_hosts(env, ["http://node7:8000/retrieve", "http://127.0.0.1:1/retrieve", "http://node7:9/x"])
    assert env["NO_PROXY"] == env["no_proxy"] == "a.example,localhost,node7,127.0.0.1"


def test_bad_urls_are_refused():
    with pytest.raises(ValueError, match="retriever url must be"):
        HttpRetriever("127.0.0.1:8000/retrieve")
    with pytest.raises(ValueError, match="request_shape"):
        HttpRetriever("http://h/retrieve", request_shape="many")


def test_server_module_runs_as_a_process(corpus, tmp_path):
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "rl_training.retrieval.server", "--corpus", str(corpus), "--port", "0"]
    proc = subprocess.Popen([*cmd, "--port-file", str(port_file)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = HttpRetriever(f"http://127.0.0.1:{port_file.read_text()}/retrieve", retries=0)
        assert client.health()["passages"] == 4
        assert client.retrieve(["Spree river"], 1).passages[0][0].id == "2"
    finally:
        proc.terminate()
        proc.wait(10)


def test_dense_retriever_without_faiss_says_what_to_install(corpus, monkeypatch):
    from rl_training.retrieval.dense import DenseRetriever

    monkeypatch.setitem(sys.modules, "faiss", None)  # what a machine without faiss has: import fails
    with pytest.raises(RuntimeError, match="needs faiss, which is not installed here: install faiss-cpu"):
        DenseRetriever("x.index", str(corpus), "intfloat/e5-base-v2", device="cpu")


def test_dense_retriever_over_a_faiss_index_through_the_server(corpus, tiny_model, tmp_path):
    """The dense path for real: faiss (CPU) over embeddings of the corpus by an encoder (the tiny model stands
    in for e5: no prefix, mean pooling, L2 normalised); a passage's own text retrieves it first."""
    faiss = pytest.importorskip("faiss")
    from rl_training.retrieval.dense import DenseRetriever, Encoder, query_prefix

    assert query_prefix("intfloat/e5-base-v2") == "query: " and query_prefix(str(tiny_model)) == ""
    passages = load_corpus(corpus)
    index = faiss.IndexFlatIP(128)  # the tiny model's hidden size; inner product of unit vectors = cosine
    enc = Encoder(str(tiny_model), device="cpu")
    index.add(np.concatenate([enc.encode([p.contents]) for p in passages]))  # one at a time: no padding
    faiss.write_index(index, str(tmp_path / "flat.index"))

    dense = DenseRetriever(str(tmp_path / "flat.index"), str(corpus), str(tiny_model), device="cpu", batch_size=2)
    res = dense.retrieve([p.contents for p in passages], 2)
    assert res.failed == 0 and [hits[0].id for hits in res.passages] == [p.id for p in passages]
    assert all(hits[0].score == pytest.approx(1.0, abs=1e-4) for hits in res.passages)  # cosine with itself
    with serve(dense, name="dense", passages=4) as url:
        client = HttpRetriever(url, retries=0)
        assert client.health() == {"status": "ok", "retriever": "dense", "passages": 4}
        assert [h[0].id for h in client.retrieve([passages[2].contents], 1).passages] == ["2"]
    with pytest.raises(
        RuntimeError, match=r"cannot load the encoder '/nonexistent/e5'.*offline, pass a local directory"
    ):
        DenseRetriever(str(tmp_path / "flat.index"), str(corpus), "/nonexistent/e5", device="cpu")
    with pytest.raises(ValueError, match="holds 4 vectors for 3 passages"):
        short = tmp_path / "short.jsonl"
        short.write_text("".join(json.dumps(d) + "\n" for d in DOCS[:3]))
        DenseRetriever(str(tmp_path / "flat.index"), str(short), str(tiny_model), device="cpu")


def test_make_retriever_from_config(corpus):
    from rl_training.config.load import load_config
    from rl_training.retrieval.build import make_retriever

    cfg = load_config(None, [f"search.corpus={corpus}"])
    assert isinstance(make_retriever(cfg.search), BM25Retriever)
    cfg.search.retriever = "none"
    assert isinstance(make_retriever(cfg.search), NullRetriever)
    cfg.search.retriever = "http"
    with pytest.raises(ValueError, match="search.retriever=http needs search.url"):
        make_retriever(cfg.search)
    cfg.search.url, cfg.search.request_shape, cfg.search.retries = "http://127.0.0.1:1/retrieve", "single", 0
    r = make_retriever(cfg.search)
    assert (r.request_shape, r.retries, r.timeout_s) == ("single", 0, 10.0)
    assert r.retrieve(["q"], 1).failed == 1  # nothing listens on port 1: an error result, not an exception
    r.close()


def test_bench_script_runs_small(tmp_path):
    """Runs end to end at tiny settings and writes the JSON it promises (speed targets: its output, docs)."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_retriever.py"), "--passages", "500", "--queries", "50"]
    cmd += ["--bm25s-queries", "10", "--requests", "5", "--repeats", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["passages"] == 500 and res["bm25_queries_per_s"] > 0 and res["bm25s_numpy_queries_per_s"] > 0
    assert set(res["http"]) == {"single_1", "batched_1", "batched_64"}
    assert all(v["requests"] == 5 and v["p95_ms"] >= v["p50_ms"] > 0 for v in res["http"].values())


def test_dense_retriever_stays_off_the_trainers_gpus(corpus, monkeypatch):
    """Issue 29 N8: the server's encoder is on the CPU unless a device is named, and the index goes to the GPUs
    named (--faiss-gpus), never to every visible one (GPU 0 is where rank 0 trains)."""
    import types

    from rl_training.retrieval import dense, server

    calls = []
    fake = types.SimpleNamespace(
        read_index=lambda path: types.SimpleNamespace(ntotal=len(dense.load_corpus(corpus))),
        GpuMultipleClonerOptions=types.SimpleNamespace,
        index_cpu_to_gpus_list=lambda index, co, gpus: calls.append(("list", gpus)) or index,
        index_cpu_to_all_gpus=lambda index, co: calls.append(("all",)) or index,
    )
    monkeypatch.setattr(dense, "_require_faiss", lambda: fake)
    monkeypatch.setattr(dense, "Encoder", lambda name, device, max_tokens: ("encoder", device))
    base = ["--corpus", str(corpus), "--retriever", "dense", "--index", "x.index", "--encoder", "e5"]
    r, _ = server.build_retriever(server.parser().parse_args(base))
    assert r.encoder == ("encoder", "cpu") and calls == []
    r, _ = server.build_retriever(server.parser().parse_args([*base, "--device", "cuda:7", "--faiss-gpus", "6,7"]))
    assert r.encoder == ("encoder", "cuda:7") and calls == [("list", [6, 7])]
