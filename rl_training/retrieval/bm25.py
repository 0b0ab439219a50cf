"""In-process BM25 over a Search-R1 corpus (jsonl of {"id", "contents"}).

Why bm25s (0.3.16, MIT, numpy as its only required dependency): it builds a Lucene-style BM25 index
(idf = log(1 + (N - df + 0.5) / (df + 0.5)), k1 = 1.5, b = 0.75) as a sparse token x document matrix of
precomputed per-posting scores in pure numpy, in ~4 s for 100k passages on one core, with no Java (pyserini,
which Search-R1's own BM25 server uses, needs a JVM and a Lucene index) and no compiled extension.
Tokenisation: lowercase, words of 2+ word characters, bm25s's English stopword list, no stemming
(PyStemmer would be one more compiled dependency).

The query side is ours, over bm25s's index arrays (`scores["data" | "indices" | "indptr"]`, the format its
save() writes): a query costs the postings of its own terms, never a pass over the corpus (see `top`).
bm25s's numpy `retrieve` scores every document densely and argpartitions all N scores per query, which
scripts/bench_retriever.py measures side by side (docs/search.md has the numbers); its numba backend is
fast once compiled but JIT-compiles for ~18 s on first use. Scores equal bm25s's `get_scores` (tested).
Ties are broken by corpus order, so results are deterministic.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import numpy as np

from rl_training.retrieval.retriever import Passage, RetrievalResult, load_corpus

STOPWORDS = "en"
SELECT_ROUNDS_MAX_K = 8  # top-k by k rounds of max up to this k, by a partition above


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, lower=True, stopwords=STOPWORDS, return_ids=False, show_progress=False)


def fingerprint(passages: list[Passage]) -> str:
    h = hashlib.sha256()
    for p in passages:
        h.update(f"{len(p.id)}:{p.id}{len(p.contents)}:{p.contents}".encode())
    return f"{len(passages)}:{h.hexdigest()}"


def _load_or_build(passages: list[Passage], index_dir: Path | None):
    import bm25s

    stamp = index_dir / "corpus.fingerprint" if index_dir else None
    if stamp is not None and stamp.exists():
        if stamp.read_text() != fingerprint(passages):
            raise ValueError(f"the BM25 index in {index_dir} was built over another corpus; delete it to rebuild")
        return bm25s.BM25.load(str(index_dir))
    index = bm25s.BM25()
    index.index(_tokenize([p.contents for p in passages]), show_progress=False)
    if index_dir is not None:
        index.save(str(index_dir), show_progress=False)
        stamp.write_text(fingerprint(passages))  # last: a half-written index has no stamp and is rebuilt
    return index


class BM25Retriever:
    """BM25 over `passages` (or a corpus file). Thread-safe for concurrent `retrieve` calls (read-only)."""

    def __init__(self, passages: list[Passage], index_dir: str | Path = ""):
        """`index_dir`: load the index saved there for these passages, or build it and save it there (bm25s's
        save format plus a fingerprint of the passages, so an index never serves another corpus)."""
        self.passages = passages
        index = _load_or_build(passages, Path(index_dir) if index_dir else None)
        self.vocab: dict[str, int] = index.vocab_dict
        self.data = np.asarray(index.scores["data"])
        self.indices = np.asarray(index.scores["indices"])
        self.indptr = np.asarray(index.scores["indptr"])
        self._bm25s = index  # kept for tests that compare against bm25s's own scoring
        self._buffer = np.zeros(len(passages))  # float64 scores, all zero between queries
        self._lock = threading.Lock()  # one buffer: a server's worker threads take turns (the GIL would anyway)

    @classmethod
    def from_corpus(cls, path, index_dir: str | Path = "") -> BM25Retriever:
        return cls(load_corpus(path), index_dir)

    def __len__(self) -> int:
        return len(self.passages)

    def top(self, query_tokens: list[str], k: int) -> list[tuple[int, float]]:
        """The k best (document index, BM25 score), score descending then corpus order. A term repeated in
        the query counts again (as in bm25s).

        Cost O(postings of the query's terms), never O(corpus): the scores accumulate into a reused dense
        buffer at the postings' documents only, are read back there (one entry per posting) and reset. Small
        k: k rounds of max over the entries (np.partition is ~30x slower per element here). Larger k: each
        document occurs at most once per term, so the k best distinct documents are among the k * terms best
        entries; those scoring at least that many-th best score (ties included) are sorted and deduplicated."""
        spans = [(self.indptr[i], self.indptr[i + 1]) for i in (self.vocab[t] for t in query_tokens if t in self.vocab)]
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            return []
        docs = np.concatenate([self.indices[a:b] for a, b in spans])
        with self._lock:
            for a, b in spans:
                self._buffer[self.indices[a:b]] += self.data[a:b]  # a term's postings name distinct documents
            sc = self._buffer[docs]
            self._buffer[docs] = 0.0
        if k > SELECT_ROUNDS_MAX_K:
            m = k * len(spans)
            if len(sc) > m:
                keep = sc >= np.partition(sc, len(sc) - m)[len(sc) - m]
                docs, sc = docs[keep], sc[keep]
            out: dict[int, float] = {}
            for j in np.lexsort((docs, -sc)):
                out.setdefault(int(docs[j]), float(sc[j]))
                if len(out) == k:
                    break
            return list(out.items())
        best = []
        for _ in range(min(k, len(sc))):  # k rounds of vectorised max: faster than a partition for small k
            top = sc.max()
            if top == -np.inf:
                break
            d = docs[sc == top].min()  # ties: corpus order
            best.append((int(d), float(top)))
            sc[docs == d] = -np.inf
        return best

    def retrieve(self, queries: list[str], topk: int) -> RetrievalResult:
        t0 = time.perf_counter()
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        out = [[self._passage(i, s) for i, s in self.top(toks, topk)] for toks in _tokenize(list(queries))]
        return RetrievalResult(out, [None] * len(out), latency_s=time.perf_counter() - t0)

    def _passage(self, i: int, score: float) -> Passage:
        p = self.passages[i]
        return Passage(p.id, p.contents, score)

    def close(self) -> None:
        pass
