"""HTTP client of a retrieval server that speaks Search-R1's /retrieve schema (ours: rl_training.retrieval.server).

Request shapes (POST, JSON):
- batched (Search-R1, search_r1/search/retrieval_server.py): {"queries": [str, ...], "topk": k,
  "return_scores": true}, one request for the whole batch;
- single (SkyRL, skyrl_gym/tools/search.py): {"query": str, "topk": k, "return_scores": true}, one request
  per query, sent concurrently.
Response, both shapes: {"result": [per query: [{"document": {"id": ..., "contents": ...}, "score": s}, ...]]}
(a single-query request gets a one-element list); without return_scores each entry is the document itself.

Failure policy: a connection error, a timeout or a 5xx status is retried up to `retries` more times with a
short doubling backoff; anything else (4xx, a malformed response) is not. Whatever still fails comes back as
errors in the RetrievalResult, never as an exception. Worst case per request:
(retries + 1) * timeout_s + the backoffs.

Proxies: cluster proxies intercepting internal traffic cost the system we grow from days, so this client
never uses one: the session ignores the environment (trust_env=False: no HTTP(S)_PROXY, no netrc) and the
proxies map is empty. `no_proxy_hosts` adds the retriever's exact host to NO_PROXY for the other tools of
the job (the SLURM launcher calls it).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal
from urllib.parse import urlsplit

from rl_training.retrieval.retriever import Passage, RetrievalResult

RETRY_STATUS = range(500, 600)


class _Retryable(Exception):
    pass


class HttpRetriever:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        request_shape: Literal["batched", "single"] = "batched",
        max_concurrency: int = 16,
    ):
        import requests

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"retriever url must be http(s)://host[:port]/retrieve, got {url!r}")
        if request_shape not in ("batched", "single"):
            raise ValueError(f"request_shape must be 'batched' or 'single', got {request_shape!r}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.request_shape = request_shape
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy (nor netrc) from the environment, whatever NO_PROXY says
        self.session.proxies = {}
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=max_concurrency, max_retries=0)  # retries: ours
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._pool = ThreadPoolExecutor(max_concurrency) if request_shape == "single" else None

    def retrieve(self, queries: list[str], topk: int) -> RetrievalResult:
        t0 = time.perf_counter()
        queries = list(queries)
        if not queries:
            return RetrievalResult([], [])
        if self._pool is None:
            res = self._request({"queries": queries, "topk": topk, "return_scores": True}, len(queries))
        else:
            parts = list(
                self._pool.map(lambda q: self._request({"query": q, "topk": topk, "return_scores": True}, 1), queries)
            )
            res = RetrievalResult(
                [p for r in parts for p in r.passages],
                [e for r in parts for e in r.errors],
                attempts=sum(r.attempts for r in parts),
                retries=sum(r.retries for r in parts),
            )
        res.latency_s = time.perf_counter() - t0
        return res

    def _request(self, payload: dict, n: int) -> RetrievalResult:
        """One POST with bounded retries; the parsed answer for `n` queries, or all n failed with the error."""
        import requests

        error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 5.0))
            try:
                resp = self.session.post(self.url, json=payload, timeout=self.timeout_s)
                if resp.status_code in RETRY_STATUS:
                    raise _Retryable(f"server error {resp.status_code}: {resp.text[:200]}")
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    break
                return RetrievalResult(*_parse(resp.json(), n), attempts=attempt + 1, retries=attempt)
            except requests.Timeout:
                error = f"timed out after {self.timeout_s:g} s"
            except requests.ConnectionError as e:
                error = f"connection failed ({type(e).__name__})"
            except _Retryable as e:
                error = str(e)
            except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
                error = f"malformed response ({type(e).__name__}: {e})"
                break
        # No url in the error: it becomes observation text the policy reads (the caller knows the url).
        return RetrievalResult.all_failed(n, error, attempts=attempt + 1, retries=attempt)

    def health(self) -> dict:
        """GET /health beside the /retrieve url (raises on failure: used at startup, not in the loop)."""
        resp = self.session.get(health_url(self.url), timeout=self.timeout_s)
        resp.raise_for_status()
        return resp.json()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.session.close()


def _parse(body: dict, n: int) -> tuple[list[list[Passage]], list[str | None]]:
    result = body["result"]
    if not isinstance(result, list) or len(result) != n:
        got = len(result) if isinstance(result, list) else type(result).__name__
        raise ValueError(f"'result' holds {got} entries for {n} queries")
    out = []
    for hits in result:
        row = []
        for h in hits:
            doc, score = (h["document"], h.get("score", 0.0)) if "document" in h else (h, 0.0)
            row.append(Passage(str(doc.get("id", "")), doc["contents"], float(score)))
        out.append(row)
    return out, [None] * n


def health_url(retrieve_url: str) -> str:
    p = urlsplit(retrieve_url)
    return f"{p.scheme}://{p.netloc}/health"


def no_proxy_hosts(env: dict[str, str], urls: list[str]) -> None:
    """Add the exact host names of `urls` to NO_PROXY and no_proxy in `env` (both spellings: tools read one or
    the other), keeping what is there. Exact names, not domain suffixes or CIDR ranges, which not every
    client understands."""
    hosts = [urlsplit(u).hostname for u in urls if urlsplit(u).hostname]
    have = [h for h in (env.get("NO_PROXY") or env.get("no_proxy") or "").split(",") if h]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(dict.fromkeys([*have, *hosts]))
