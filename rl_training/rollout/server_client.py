"""The HTTP client of stock vLLM servers (rollout.backend=server): bounded retries with doubling backoff and
failover between URLs, one `requests` session per thread, `trust_env=False` (no proxy from the environment ever
sees the servers' traffic). The backend (server.py) and the weight publishers (server_sync.py) both use it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rl_training.base.errors import UserError


class ServerError(UserError, RuntimeError):
    """A server that stayed unreachable after the retries, or refused a request; the message is one line."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _message(response) -> str:
    """The error text of a vLLM JSON error ({"error": {"message": ...}} or FastAPI's {"detail": ...})."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else response.reason
    err = body.get("error", body) if isinstance(body, dict) else body
    text = err.get("message") or err.get("detail") if isinstance(err, dict) else err
    return " ".join(str(text).split())[:500]


@dataclass
class ServerClient:
    """Bounded-retry JSON calls to a fixed set of server URLs; thread-safe (one session per thread)."""

    urls: list[str]
    timeout_s: float
    retries: int
    backoff_s: float
    concurrency: int = 8

    def __post_init__(self):
        self.urls = [u.rstrip("/") for u in self.urls]
        self._local = threading.local()
        self._lock = threading.Lock()
        self.retried = 0  # requests sent again after a failure, since start (logged as a counted metric)
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="vllm-client")

    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            import requests

            s = requests.Session()
            s.trust_env = False  # ignore HTTP(S)_PROXY / NO_PROXY and .netrc: the servers are reached directly
            self._local.session = s
        return s

    def request(self, method: str, path: str, body: dict | None = None, *, url: int | str = 0, retry_5xx=True):
        """The decoded JSON (or text) answer of `method url+path`. `url`: a base URL, or an index into
        self.urls where attempt k goes to urls[(index + k) % len] (failover for idempotent calls)."""
        import requests

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            base = url if isinstance(url, str) else self.urls[(url + attempt) % len(self.urls)]
            try:
                r = self._session().request(method, base + path, json=body, timeout=self.timeout_s)
            except requests.RequestException as e:
                last = f"{base}: {type(e).__name__}"
                continue
            if r.status_code >= 500 and retry_5xx:
                last = f"{base}: HTTP {r.status_code} {_message(r)}"
                continue
            if r.status_code >= 400:
                raise ServerError(f"{base}{path}: HTTP {r.status_code}: {_message(r)}", r.status_code)
            try:
                return r.json()
            except ValueError:
                return r.text
        raise ServerError(
            f"vLLM server {path} failed after {self.retries} retries ({last}); check the server "
            "(docs/server.md), then continue the run with ckpt.resume=latest"
        )

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until every URL answers /health with 200, or raise after timeout_s (servers load for a while)."""
        import requests

        deadline = time.monotonic() + timeout_s
        for base in self.urls:
            while True:
                try:
                    if self._session().get(base + "/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass  # not up yet: retried until the deadline
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"vLLM server {base} not healthy after {timeout_s:.0f} s (server.startup_timeout_s)"
                    )
                time.sleep(1.0)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def base_model_name(client: ServerClient) -> str:
    """The served name of the first server's base model (the /v1/models entry without a parent adapter)."""
    models = client.request("GET", "/v1/models", url=0)["data"]
    return next(m["id"] for m in models if not m.get("parent"))
