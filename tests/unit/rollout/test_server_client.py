"""The server backend's HTTP client and seeds without a vLLM server (fast): disjoint per-request seed streams,
bounded retries with a one-line error, 4xx not retried, a server that comes back, proxies ignored, and the
server: config checks. The real server is in tests/integration/test_server_backend.py."""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.rollout.local_server import free_port
from rl_training.rollout.server import request_seeds
from rl_training.rollout.server_client import ServerClient, ServerError


class Scripted(ThreadingHTTPServer):
    """Answers each request with the next (status, body) of `script`; the last one repeats."""

    def __init__(self, script: list[tuple[int, dict]]):
        self.script, self.seen = script, []

        class Handler(BaseHTTPRequestHandler):
            def _answer(h):
                n = int(h.headers.get("Content-Length") or 0)
                self.seen.append((h.command, h.path, h.rfile.read(n)))
                status, body = self.script[min(len(self.seen) - 1, len(self.script) - 1)]
                data = json.dumps(body).encode()
                h.send_response(status)
                h.send_header("Content-Type", "application/json")
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                h.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(h, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def scripted():
    servers = []

    def make(script):
        servers.append(Scripted(script))
        return servers[-1]

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def test_request_seeds_give_every_completion_its_own_stream():
    # vLLM samples child j of a request with seed s + j: streams are the integer ranges [s, s + n).
    for n_req, n in ((64, 8), (200, 16), (3, 1)):
        seeds = request_seeds(12345, n_req, n)
        ranges = [set(range(s, s + n)) for s in seeds]
        assert all(not (a & b) for a, b in itertools.combinations(ranges, 2))
        assert all(0 <= s and s + n < 2**63 for s in seeds)  # vLLM's seed field is an int64
    assert request_seeds(7, 16, 8) == request_seeds(7, 16, 8)  # a pure function: resume draws the same
    assert not set(request_seeds(7, 16, 8)) & set(request_seeds(8, 16, 8))  # other steps / ranks differ
    # The scheme it replaces: per-prompt seeds seed + i with n = 8 share 7 of 8 streams with the next prompt.
    naive = [set(range(100 + i, 100 + i + 8)) for i in range(2)]
    assert len(naive[0] & naive[1]) == 7


def test_dead_server_is_one_line_error_after_the_retries():
    port = free_port()  # nothing listens there
    client = ServerClient([f"http://127.0.0.1:{port}"], timeout_s=2, retries=2, backoff_s=0.01)
    with pytest.raises(ServerError) as e:
        client.request("POST", "/v1/completions", {"prompt": [1]})
    msg = str(e.value)
    assert "\n" not in msg and "after 2 retries" in msg and f"127.0.0.1:{port}" in msg and "ConnectionError" in msg
    assert client.retried == 2  # 1 attempt + 2 retries


def test_bad_request_is_not_retried(scripted):
    srv = scripted([(400, {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}})])
    client = ServerClient([srv.url], timeout_s=5, retries=3, backoff_s=0.01)
    with pytest.raises(ServerError) as e:
        client.request("POST", "/v1/completions", {"prompt": [1]})
    assert e.value.status == 400 and "prompt too long" in str(e.value)
    assert len(srv.seen) == 1 and client.retried == 0


def test_server_errors_are_retried_until_the_server_is_back(scripted):
    srv = scripted([(503, {"detail": "loading"}), (500, {"error": {"message": "busy"}}), (200, {"ok": 1})])
    client = ServerClient([srv.url], timeout_s=5, retries=2, backoff_s=0.01)
    assert client.request("POST", "/x", {}) == {"ok": 1}
    assert len(srv.seen) == 3 and client.retried == 2


def test_retries_fail_over_to_the_next_url(scripted):
    good = scripted([(200, {"ok": 1})])
    dead = f"http://127.0.0.1:{free_port()}"
    client = ServerClient([dead, good.url], timeout_s=5, retries=1, backoff_s=0.01)
    assert client.request("POST", "/x", {}, url=0) == {"ok": 1}  # attempt 0 -> dead, attempt 1 -> good
    assert client.retried == 1


def test_environment_proxies_are_ignored(scripted, monkeypatch):
    srv = scripted([(200, {"ok": 1})])
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, dead_proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = ServerClient([srv.url], timeout_s=5, retries=0, backoff_s=0)
    assert client.request("GET", "/health") == {"ok": 1}  # through a proxy it would be a ConnectionError
    assert srv.seen[0][:2] == ("GET", "/health")


def test_wait_healthy_has_a_deadline():
    client = ServerClient([f"http://127.0.0.1:{free_port()}"], timeout_s=1, retries=0, backoff_s=0)
    with pytest.raises(ServerError, match="not healthy after 1 s"):
        client.wait_healthy(1.0)


def test_server_config_checks():
    with pytest.raises(ConfigError, match="not a base URL"):
        load_config(None, ["rollout.backend=server", "server.urls=[127.0.0.1:8000]"])
    with pytest.raises(ConfigError, match="must be >= 1"):
        load_config(None, ["server.keep_versions=0"])
    cfg = load_config(None, ["rollout.backend=server", "server.urls=[http://a:8000, http://b:8000/]"])
    assert cfg.server.urls == ["http://a:8000", "http://b:8000/"] and cfg.server.weight_sync == "lora"
