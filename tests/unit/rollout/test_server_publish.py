"""Publishing weights to vLLM servers, the parts a CPU can check (issue 29): a publish failure of any kind reaches
every rank at once (N6), and the NCCL push reads each merged weight only after the default stream (N5) and after
its merge, on whichever side stream that ran (issue 41, item 1)."""

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


class Stream:
    """A CUDA stream for ordering only: its own ops, and the ops of others it has waited for."""

    def __init__(self, name):
        self.name, self.ops, self.waited = name, [], set()

    def seen(self) -> set[str]:
        return set(self.ops) | self.waited

    def wait_stream(self, other):
        self.waited |= other.seen()

    def record_event(self):
        return frozenset(self.seen())

    def wait_event(self, event):
        self.waited |= event


class Weight:
    is_cuda = True

    def __init__(self, name):
        self.name, self.read_on = name, []

    def record_stream(self, stream):
        self.read_on.append(stream.name)


def test_every_merged_weight_is_read_after_its_merge_and_the_optimizer(monkeypatch):
    """Issue 29 N5, issue 41 item 1: vLLM's producer pulls the merged weights inside its two side streams in turn.
    The batched merge runs at the first pull (on side stream A) and its views are read on A and, once the chunk is
    full, on B; each read must be ordered after the merge and after the optimizer step on the default stream."""
    default, a, b = Stream("default"), Stream("A"), Stream("B")
    default.ops.append("optimizer step")
    current = [a]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: default)
    weights = [Weight(n) for n in ("q_proj.0", "v_proj.0", "q_proj.1", "v_proj.1")]

    def merged():  # merged_hf_weights' order of work: one batched merge, then its views one by one
        current[0].ops.append("merge")
        yield from ((w.name, w) for w in weights)

    pulls = server_sync.ordered_on_side_streams(merged())
    for stream, w in zip([a, a, b, b], weights, strict=True):
        current[0] = stream
        assert next(pulls) == (w.name, w)
        assert {"merge", "optimizer step"} <= stream.seen(), f"{w.name} read on {stream.name} unordered"
        stream.ops.append(f"pack {w.name}")
    assert [w.read_on for w in weights] == [["A"], ["A"], ["B"], ["B"]]  # the allocator knows who reads them
    assert next(pulls, None) is None


def test_the_nccl_weight_source_iterates_through_the_ordering(monkeypatch):
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import rl_training.policy.models as models

    seen = []
    monkeypatch.setattr(models, "merged_hf_weights", lambda model: iter([("w", torch.ones(2))]))
    monkeypatch.setattr(server_sync, "ordered_on_side_streams", lambda pairs: (seen.append("ordered"), pairs)[1])
    source = server_sync.merged_weight_source(object())
    assert [n for n, _ in source] == ["w"] and seen == ["ordered"]
