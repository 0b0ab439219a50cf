"""What backends declare (rollout/kinds.py): their config rules, run before any model loads; whether a group's prompt
is prefilled once; what to check when the canary stops a run. Nothing outside rollout/ branches on a backend's
name; a user's backend declares the same three or gets the defaults."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from rl_training.config.load import load_config
from rl_training.config.plugins import BACKEND_NAMES
from rl_training.config.resolve import resolve
from rl_training.config.schema import ConfigError
from rl_training.rollout.factory import BUILDERS
from rl_training.rollout.kinds import KINDS, VLLM_LORA_RANKS, backend_kind, check_backend, vllm_max_lora_rank
from tests.helpers import REPO


def checked(overrides: list[str], training: bool = True):
    """The config as a command that builds a backend sees it: loaded, resolved ('auto' -> vllm here), checked."""
    cfg = resolve(load_config(None, overrides, training=training)).cfg
    check_backend(cfg, training=training)
    return cfg


def test_the_names_the_config_checks_are_the_backends_that_exist():
    assert set(BACKEND_NAMES) == set(KINDS) == set(BUILDERS)
    assert {k: v.prefix_cache for k, v in KINDS.items()} == {"hf": False, "vllm": True, "server": True}


def test_nothing_outside_rollout_compares_a_backend_name():
    """Issue 51, item 3: a backend's facts live with the backends; a user's backend is no longer handed HF's."""
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](hf|vllm|server)["']""")
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / "rl_training").rglob("*.py"))
        if "rollout" not in p.relative_to(REPO / "rl_training").parts[:1]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and "backend" in line
    ]
    assert hits == []


def test_lora_weight_sync_never_sleeps_at_level_2():
    """Issue 29 N1: level 2 discards the base weights and weight_sync=lora never sends them again. Refused before
    the model loads (training) and by the engine itself, before it builds (a config made in code skips the check)."""
    from rl_training.base.dist import DistInfo
    from rl_training.rollout.vllm_engine import VLLMBackend

    msg = r"vllm.weight_sync=lora with vllm.sleep_level=2: level 2 discards the base weights"
    with pytest.raises(ConfigError, match=msg):
        checked(["vllm.weight_sync=lora"])
    for ok in (["vllm.sleep_level=1"], ["vllm.sleep=false"], ["rollout.backend=hf"]):
        checked(["vllm.weight_sync=lora", *ok])
    assert checked(["vllm.weight_sync=lora"], training=False).vllm.sleep_level == 2  # evals never sleep
    cfg = checked(["vllm.weight_sync=lora", "vllm.sleep_level=1"])
    bad = dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, sleep_level=2))
    with pytest.raises(ConfigError, match=msg):
        VLLMBackend(bad, None, None, DistInfo(0, 0, 1, torch.device("cpu")))


def test_lora_ranks_vllm_cannot_serve_round_up_or_are_refused():
    """Issue 41, item 2: vLLM 0.32 takes max_lora_rank only from {1, 8, 16, 32, 64, 128, 256, 320, 512}; lora.r=24
    failed at engine build. The engine gets the next one up; a rank past 512 is refused before the model loads."""
    import typing

    lora = pytest.importorskip("vllm.config.lora")
    assert VLLM_LORA_RANKS == typing.get_args(lora.MaxLoRARanks)  # the installed vLLM's own list
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 24, 48, 300, 320, 321, 512)] == [
        1, 8, 8, 16, 32, 64, 320, 320, 512, 512,
    ]  # fmt: skip
    for sync in (
        ["vllm.weight_sync=lora", "vllm.sleep_level=1"],
        ["rollout.backend=server", "server.urls=[http://h:1]"],
    ):
        with pytest.raises(ConfigError, match=r"^lora.r=600: vLLM serves LoRA ranks up to 512; lower lora.r"):
            checked([*sync, "lora.r=600"])
        checked([*sync, "lora.r=512"])
    checked(["lora.r=600"])  # merged weights (the default sync): any rank
    checked(["rollout.backend=hf", "lora.r=600"])


def test_server_and_async_rules():
    with pytest.raises(ConfigError, match="rollout.backend=server needs server.urls"):
        checked(["rollout.backend=server"])
    for backend in ("hf", "vllm"):
        with pytest.raises(ConfigError, match=f"max_async_level=1 needs rollout.backend=server \\(got {backend}\\)"):
            checked([f"rollout.backend={backend}", "rollout.max_async_level=1", "loss.tis_cap=2"])
    server = ["rollout.backend=server", "server.urls=[http://h:1]", "rollout.max_async_level=1", "loss.tis_cap=2"]
    with pytest.raises(ConfigError, match="needs server.weight_sync=lora"):
        checked([*server, "server.weight_sync=full"])
    checked(server)
    checked(["rollout.backend=hf", "rollout.max_async_level=1", "loss.tis_cap=2"], training=False)  # evals: no async


USER_BACKENDS = """
from rl_training.config.schema import ConfigError
from rl_training.rollout.factory import hf_backend


class Declared:
    prefix_cache = True

    @staticmethod
    def check(cfg):
        if cfg.rollout.temperature != 1.0:
            raise ConfigError("declared: rollout.temperature must be 1")

    @staticmethod
    def canary_advice(cfg):
        return "the declared backend's own weight path"

    def __new__(cls, ctx):
        return hf_backend(ctx)


def silent(ctx):
    return hf_backend(ctx)
"""


def test_a_user_backend_declares_its_rules_prefix_cache_and_advice_or_gets_the_defaults(tmp_path):
    f = tmp_path / "my_backends.py"
    f.write_text(USER_BACKENDS)
    declared = checked([f"rollout.backend={f}:Declared"])
    kind = backend_kind(declared)
    assert kind.prefix_cache and kind.canary_advice(declared) == "the declared backend's own weight path"
    with pytest.raises(ConfigError, match="declared: rollout.temperature must be 1"):
        checked([f"rollout.backend={f}:Declared", "rollout.temperature=0.7"])
    silent = checked([f"rollout.backend={f}:silent", "rollout.temperature=0.7"])
    kind = backend_kind(silent)
    assert not kind.prefix_cache and "sync_weights" in kind.canary_advice(silent)
    assert "HF backend" not in kind.canary_advice(silent)  # not the built-in hf's advice
    with pytest.raises(ConfigError, match="is not a built-in backend"):
        check_backend(load_config(None, ["rollout.backend=vlm"], training=False))


def test_the_guard_names_the_backends_advice():
    from rl_training.train.weight_guard import WeightGuard

    cfg = checked(["rollout.backend=server", "server.urls=[http://h:1]", "rollout.canary_stop_steps=1"])
    guard = WeightGuard(cfg, advice=backend_kind(cfg).canary_advice(cfg))
    guard._judge(0, {"low": 0.0, "high": 0.0}, 1.0)
    assert guard.tripped() and "the server publish (server.weight_sync=lora)" in str(guard.error(1, "saved"))
