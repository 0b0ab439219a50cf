"""The backend protocols (rollout/base.py): a versioned backend's extra methods are a protocol of their own,
reached through the episode wrapper by explicit methods (no attribute forwarding), and refused by name when
rollout.max_async_level > 0 meets a backend without them."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.rollout.base import RolloutBackend, VersionedBackend
from rl_training.rollout.episodes import EpisodeBackend, with_episodes
from rl_training.rollout.factory import versioned
from rl_training.tasks import Environment, Step

ASYNC = ["rollout.backend=server", "server.urls=[http://h:1]", "loss.tis_cap=2", "rollout.max_async_level=1"]


class Plain:
    name = "plain"
    engine = "an engine's internals"  # not part of any protocol

    def generate(self, prompts, spec, examples=None): ...
    def generate_turn(self, contexts, max_tokens, seeds, spec, stop): ...
    def sync_weights(self, model): ...
    def sleep(self): ...
    def wake(self): ...
    def metrics(self):
        return {}

    def close(self): ...


class Versions(Plain):
    name = "versions"

    def __init__(self):
        self.calls = []

    @contextmanager
    def pinned(self, version):
        self.calls.append(("pinned", version))
        yield

    def republish(self, version, adapter_dir):
        self.calls.append(("republish", version, adapter_dir))

    def version_dirs(self, versions):
        return {v: f"v{v}" for v in versions}


class Echo(Environment):
    def step(self, state, turn):
        return Step(done=True)


def test_the_protocols_tell_a_versioned_backend_from_a_plain_one():
    assert isinstance(Plain(), RolloutBackend) and not isinstance(Plain(), VersionedBackend)
    assert isinstance(Versions(), VersionedBackend)


def test_episodes_keep_the_versions_of_a_versioned_backend_and_only_those():
    cfg, tok = load_config(None, []), build_tokenizer()
    inner = Versions()
    wrapped = with_episodes(cfg, inner, tok, Echo())
    assert isinstance(wrapped, EpisodeBackend) and isinstance(wrapped, VersionedBackend)
    with wrapped.pinned(3):
        pass
    wrapped.republish(2, "/ckpt/v2")
    assert inner.calls == [("pinned", 3), ("republish", 2, "/ckpt/v2")]
    assert wrapped.version_dirs([1, 2]) == {1: "v1", 2: "v2"}
    plain = with_episodes(cfg, Plain(), tok, Echo())
    assert not isinstance(plain, VersionedBackend)
    # nothing reaches the wrapped backend by attribute forwarding: only the protocols' methods
    assert not hasattr(plain, "pinned") and not hasattr(plain, "engine") and not hasattr(wrapped, "engine")
    with pytest.raises(ConfigError, match=r"rollout.backend=server has no pinned, republish, version_dirs"):
        versioned(plain, load_config(None, ASYNC))
    assert versioned(wrapped, load_config(None, ASYNC)) is wrapped
