"""Fixtures of the integration tier: a real vLLM OpenAI server (the CPU build) for the server-backend tests,
started once per session on 127.0.0.1 with an ephemeral port (~20-30 s; once per module it cost the tier three
starts), and the overrides that point a run at it."""

from __future__ import annotations

import pytest

from rl_training.rollout.local_server import VLLMServer
from tests.helpers import server_cpus


@pytest.fixture(scope="session")
def server(warm_model, tmp_path_factory):
    # rank 16: the demo's adapter (cfg/tiny_cpu.yaml, test_server_async.py); the tests' own rank 8 fits under it
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    srv = VLLMServer(warm_model, log, max_lora_rank=16, cpus=server_cpus()).start()
    yield srv
    srv.stop()


@pytest.fixture
def server_overrides(run_overrides, server):
    return [
        *run_overrides,
        "rollout.backend=server",
        f"server.urls=[{server.url}]",
        "server.served_model=base",
        "rollout.temperature=0.7",
        "server.retries=1",
        "server.backoff_s=0.2",
    ]
