"""Publishing weights to vLLM servers, the parts a CPU can check (issue 29): a publish failure of any kind reaches
every rank at once (N6), and the NCCL push computes each merged weight only after the default stream (N5)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.rollout import server_sync
from tests.helpers import free_port
from tests.workers import ddp_worker


def test_any_publish_failure_reaches_every_rank(tmp_path):
    mp.spawn(ddp_worker.publish_failure_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # rank 0 keeps the original exception; rank 1 stops with it as one line, without waiting for a timeout
    assert r0["error"] == "RuntimeError: NCCL error: unhandled system error\n(second line)"
    one_line = "weight publish failed on rank 0: RuntimeError: NCCL error: unhandled system error (second line)"
    assert r1["error"] == f"ServerError: {one_line}"
    assert r1["s"] < 30


def test_each_merged_weight_is_computed_after_the_default_stream(monkeypatch):
    """vLLM pulls the merged weights inside its side streams: before each one is computed, the current (side)
    stream must wait for the default stream, where the optimizer wrote the parameters."""
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream("side"))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: Stream("default"))

    def merged():
        for name in ("q_proj", "v_proj"):
            events.append(f"merge {name}")
            yield name, torch.zeros(1)

    assert [n for n, _ in server_sync.after_default_stream(merged())] == ["q_proj", "v_proj"]
    assert events == [
        "side waits for default", "merge q_proj", "side waits for default", "merge v_proj", "side waits for default"
    ]  # fmt: skip


def test_the_nccl_weight_source_iterates_through_the_ordering(monkeypatch):
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import rl_training.policy.models as models

    seen = []
    monkeypatch.setattr(models, "merged_hf_weights", lambda model: iter([("w", torch.ones(2))]))
    monkeypatch.setattr(server_sync, "after_default_stream", lambda pairs: (seen.append("ordered"), pairs)[1])
    source = server_sync.merged_weight_source(object())
    assert [n for n, _ in source] == ["w"] and seen == ["ordered"]
