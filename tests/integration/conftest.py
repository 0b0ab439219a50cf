"""Fixtures of the integration tier: a real vLLM OpenAI server (the CPU build) for the server-backend tests,
started once per module on 127.0.0.1 with an ephemeral port (~20-40 s), and the overrides that point a run at it."""

from __future__ import annotations

import pytest

from rl_training.rollout.local_server import VLLMServer


@pytest.fixture(scope="module")
def server(warm_model, tmp_path_factory):
    srv = VLLMServer(warm_model, tmp_path_factory.mktemp("vllm-server") / "server.log").start()
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
