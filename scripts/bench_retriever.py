"""Speed of the search retrievers: BM25 queries/s over N synthetic passages, and client + server round trips.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_retriever.py [--passages 100000 --queries 4000]

Passages: 40 words each from a Zipf-distributed vocabulary of 50k words (s = 1.1, like English text) whose
first 100 ranks are cut (stopwords); a query is 5 words of one passage, so every query hits. Reported, medians of
--repeats runs:
- bm25 (ours, rl_training/retrieval/bm25.py): queries/s of one batched retrieve() call, topk 3, one thread;
- bm25s retrieve (its numpy backend, dense scoring) on a subset, side by side, for the ratio;
- HTTP round trip over loopback to `python -m rl_training.retrieval.server`'s app: p50/p95 latency of one
  1-query request (SkyRL's shape), of one 1-query batched request, and of one 64-query batch.
Prints a table and the JSON (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPES = (("single_1", "single", 1), ("batched_1", "batched", 1), ("batched_64", "batched", 64))
HEAD = 100  # Zipf ranks treated as stopwords (not generated)


def synthetic_corpus(n: int, vocab: int, words: int, seed: int):
    from rl_training.retrieval.retriever import Passage

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(3, 9))) for _ in range(vocab)]
    # Zipf over the vocabulary with the head cut off, as BM25's stopword removal cuts it from real text: the
    # most common word is then in ~2% of passages.
    p = (np.arange(vocab) + HEAD) ** -1.1
    ranks = rng.choice(vocab, size=(n, words), p=p / p.sum())
    return [Passage(str(i), f"t{i}\n" + " ".join(lexicon[j] for j in row)) for i, row in enumerate(ranks)]


def percentile_ms(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


def round_trips(retriever, queries: list[str], n: int) -> dict:
    import uvicorn

    from rl_training.retrieval.client import HttpRetriever
    from rl_training.retrieval.server import listen, make_app

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(retriever), log_level="error", access_log=False))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/retrieve"
    out = {}
    try:
        for name, shape, size in SHAPES:
            client = HttpRetriever(url, timeout_s=30, retries=0, request_shape=shape)
            lat = []
            for i in range(n):
                batch = [queries[(i * size + j) % len(queries)] for j in range(size)]
                t0 = time.perf_counter()
                res = client.retrieve(batch, 3)
                lat.append(time.perf_counter() - t0)
                assert res.failed == 0, res.errors
            client.close()
            out[name] = {"p50_ms": percentile_ms(lat, 50), "p95_ms": percentile_ms(lat, 95), "requests": n}
    finally:
        server.should_exit = True
        th.join(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=4000)
    ap.add_argument("--bm25s-queries", type=int, default=200, help="subset for bm25s's own retrieve (slow)")
    ap.add_argument("--requests", type=int, default=200, help="HTTP requests per shape")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "retriever.json"))
    a = ap.parse_args()
    import bm25s

    from rl_training.retrieval.bm25 import BM25Retriever, _tokenize

    corpus = synthetic_corpus(a.passages, 50_000, 40, a.seed)
    rng = np.random.default_rng(a.seed + 1)
    queries = [" ".join(corpus[i].contents.split("\n")[1].split()[:5]) for i in rng.integers(0, len(corpus), a.queries)]
    t0 = time.perf_counter()
    bm25 = BM25Retriever(corpus)
    index_s = time.perf_counter() - t0

    ours, theirs = [], []
    sub = _tokenize(queries[: a.bm25s_queries])
    for _ in range(a.repeats):  # alternated, so both see the same machine load
        t0 = time.perf_counter()
        bm25.retrieve(queries, 3)
        ours.append(len(queries) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        bm25._bm25s.retrieve(sub, k=3, show_progress=False, backend_selection="numpy")
        theirs.append(len(sub) / (time.perf_counter() - t0))
    result = {
        "passages": a.passages,
        "index_s": index_s,
        "bm25_queries_per_s": statistics.median(ours),
        "bm25s_numpy_queries_per_s": statistics.median(theirs),
        "bm25s_version": bm25s.__version__,
        "http": round_trips(bm25, queries, a.requests),
    }
    print(f"{'passages':<34}{a.passages:>12,}\n{'index build (s)':<34}{index_s:>12.1f}")
    print(f"{'bm25 (ours) queries/s, topk 3':<34}{result['bm25_queries_per_s']:>12,.0f}")
    print(f"{'bm25s numpy retrieve queries/s':<34}{result['bm25s_numpy_queries_per_s']:>12,.0f}")
    for name, r in result["http"].items():
        print(f"{'http ' + name + ' p50 / p95 (ms)':<34}{r['p50_ms']:>6.1f} / {r['p95_ms']:.1f}")
    print(json.dumps(result))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
