"""The retriever interface (the search task family's, tasks/search/), the corpus reader, and the observation text.

A retriever answers a batch of queries with the top-k passages of each: `retrieve(queries, topk)`. It never
raises for what the retrieval does (a dead or slow server, a bad response): it returns a `RetrievalResult`
whose failed queries carry an error string, so the episode engine turns them into observation text and a
counted metric and the run goes on. Implementations: `bm25.BM25Retriever` (in-process),
`client.HttpRetriever` (a /retrieve server), `NullRetriever` (returns nothing: the no-retrieval ablation).

Observation text is Search-R1's, character for character (search_r1/llm_agent/generation.py):
`_passages2string` gives 'Doc {i}(Title: {first line}) {other lines}\\n' per passage, and a search turn's
observation is '\\n\\n<information>{that text, stripped}</information>\\n\\n'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl_training.data.sources import DataError, records_from_file


class CorpusError(DataError):
    """A malformed corpus file; the message names file:line."""


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str  # Search-R1 / wiki-18 form: '"Title"\ntext' (first line is the title)
    score: float = 0.0


@dataclass
class RetrievalResult:
    """The answer to one batch of queries, in query order. A failed query has no passages and an error."""

    passages: list[list[Passage]]  # [query][rank]
    errors: list[str | None]  # [query] None = retrieved (possibly zero passages); else why it failed
    latency_s: float = 0.0  # wall time of the whole batch, retries included
    attempts: int = 1  # requests made (HTTP); 1 in-process
    retries: int = 0  # attempts beyond the first per request, summed over requests

    @property
    def failed(self) -> int:
        return sum(e is not None for e in self.errors)

    @classmethod
    def all_failed(cls, n: int, error: str, **kw) -> RetrievalResult:
        return cls([[] for _ in range(n)], [error] * n, **kw)


@dataclass
class RetrievalStats:
    """Counters an episode engine accumulates over a step and logs (retrieval/*)."""

    queries: int = 0
    failed: int = 0
    retries: int = 0
    latencies_s: list[float] = field(default_factory=list)  # one per batch call

    def add(self, r: RetrievalResult) -> None:
        self.queries += len(r.errors)
        self.failed += r.failed
        self.retries += r.retries
        self.latencies_s.append(r.latency_s)

    def measure(self, meter) -> None:
        """retrieval/* into the step's meter (base/meter.py): the counts summed over ranks, the batch latency's
        p50/p95 in ms (nearest rank; 0 without calls) the slowest rank's."""
        lat = sorted(self.latencies_s)

        def pct(q: float) -> float:
            return 1e3 * lat[min(len(lat) - 1, math.ceil(q * len(lat)) - 1)] if lat else 0.0

        meter.add("retrieval/queries", self.queries)
        meter.add("retrieval/failed", self.failed)
        meter.add("retrieval/retries", self.retries)
        meter.max("retrieval/latency_p50_ms", pct(0.50))
        meter.max("retrieval/latency_p95_ms", pct(0.95))


class Retriever(Protocol):
    def retrieve(self, queries: list[str], topk: int) -> RetrievalResult: ...

    def close(self) -> None: ...


class NullRetriever:
    """Every query retrieves nothing (no error): the ablation that shows the task needs the retriever."""

    def retrieve(self, queries: list[str], topk: int) -> RetrievalResult:
        return RetrievalResult([[] for _ in queries], [None] * len(queries))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ observations
def format_passages(passages: list[Passage]) -> str:
    """Search-R1's `_passages2string`: the title is the first line of `contents`, the text the rest."""
    out = ""
    for i, p in enumerate(passages):
        lines = p.contents.split("\n")
        title, text = lines[0], "\n".join(lines[1:])
        out += f"Doc {i + 1}(Title: {title}) {text}\n"
    return out


def information_block(passages: list[Passage], error: str | None = None) -> str:
    """The observation appended after a `<search>` turn, as Search-R1 writes it. A failed retrieval reads
    'Search failed: <error>' inside the same tags, so the policy sees a well-formed turn either way."""
    body = f"Search failed: {error}" if error is not None else format_passages(passages)
    return f"\n\n<information>{body.strip()}</information>\n\n"


# ------------------------------------------------------------------------------------------------ corpus
def load_corpus(path: str | Path) -> list[Passage]:
    """A Search-R1 corpus: jsonl, one {"id": str|int, "contents": str} per line (wiki-18.jsonl's form;
    other keys are ignored). Ids must be unique."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise CorpusError(f"{path}: a corpus is a .jsonl file")
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    out: list[Passage] = []
    seen: set[str] = set()
    for where, rec in records_from_file(path):  # the data loader's jsonl reader: file:line in its errors
        if not isinstance(rec, dict) or "contents" not in rec or "id" not in rec:
            raise CorpusError(f'{where}: expected an object with "id" and "contents"')
        if not isinstance(rec["contents"], str):
            raise CorpusError(f'{where}: "contents" must be a string')
        pid = str(rec["id"])
        if pid in seen:
            raise CorpusError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        out.append(Passage(pid, rec["contents"]))
    if not out:
        raise CorpusError(f"{path}: empty corpus")
    return out
