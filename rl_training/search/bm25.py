"""In-process BM25 over a Search-R1 corpus (jsonl of {"id", "contents"}).

Why bm25s (0.3.16, MIT, numpy as its only required dependency): it builds a Lucene-style BM25 index
(idf = log(1 + (N - df + 0.5) / (df + 0.5)), k1 = 1.5, b = 0.75) as a sparse token x document matrix of
precomputed per-posting scores in pure numpy, in ~4 s for 100k passages on one core, with no Java (pyserini,
which Search-R1's own BM25 server uses, needs a JVM and a Lucene index) and no compiled extension.
Tokenisation: lowercase, words of 2+ word characters, bm25s's English stopword list, no stemming
(PyStemmer would be one more compiled dependency).

The query side is ours, over bm25s's index arrays (`scores["data" | "indices" | "indptr"]`, the format its
save() writes): a query touches only the postings of its own terms, summed with np.unique + np.bincount,
and the top k is taken among the documents that scored at all. bm25s's numpy `retrieve` instead scores
every document densely and argpartitions all N scores, ~60 queries/s over 100k passages (argpartition
degrades on the mostly-zero array); its numba backend reaches ~5,000/s but JIT-compiles for ~18 s on first
use. This path measures ~10,000 queries/s (scripts/bench_retriever.py). Scores equal bm25s's
`get_scores` (tested). Ties are broken by corpus order, so results are deterministic.
"""

from __future__ import annotations

import time

import numpy as np

from rl_training.search.retriever import Passage, RetrievalResult, load_corpus

STOPWORDS = "en"


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, lower=True, stopwords=STOPWORDS, return_ids=False, show_progress=False)


class BM25Retriever:
    """BM25 over `passages` (or a corpus file). Thread-safe for concurrent `retrieve` calls (read-only)."""

    def __init__(self, passages: list[Passage]):
        import bm25s

        self.passages = passages
        index = bm25s.BM25()
        index.index(_tokenize([p.contents for p in passages]), show_progress=False)
        self.vocab: dict[str, int] = index.vocab_dict
        self.data = np.asarray(index.scores["data"])
        self.indices = np.asarray(index.scores["indices"])
        self.indptr = np.asarray(index.scores["indptr"])
        self._bm25s = index  # kept for tests that compare against bm25s's own scoring

    @classmethod
    def from_corpus(cls, path) -> BM25Retriever:
        return cls(load_corpus(path))

    def __len__(self) -> int:
        return len(self.passages)

    def scores(self, query_tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(document indices, BM25 scores) of every document that shares a term with the query, indices
        ascending. A term repeated in the query counts again (as in bm25s)."""
        ids = [self.vocab[t] for t in query_tokens if t in self.vocab]
        if not ids:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        docs = np.concatenate([self.indices[self.indptr[i] : self.indptr[i + 1]] for i in ids])
        weights = np.concatenate([self.data[self.indptr[i] : self.indptr[i + 1]] for i in ids])
        uniq, inverse = np.unique(docs, return_inverse=True)
        return uniq, np.bincount(inverse, weights=weights.astype(np.float64))

    def top(self, query_tokens: list[str], k: int) -> list[tuple[int, float]]:
        docs, sc = self.scores(query_tokens)
        if len(docs) > k:
            part = np.argpartition(-sc, k - 1)[:k]
            docs, sc = docs[part], sc[part]
        order = np.lexsort((docs, -sc))  # score descending, then corpus order
        return [(int(docs[j]), float(sc[j])) for j in order]

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
