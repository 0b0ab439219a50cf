"""The weight-state guard (issue 30, item 1) on the real runner: each injected failure (RL_FAULT_INJECT,
rl_training/base/faults.py) stops the run within the stated number of steps, checkpointed first and with exit
status 70; the same runs without the fault never trip it (every other test of the runner runs with the guard on
by default too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_training.base import faults
from rl_training.base.exit_codes import WEIGHT_STATE_EXIT_CODE
from rl_training.ckpt.store import list_checkpoints
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, VLLM

pytestmark = pytest.mark.slow

# lr 1e-2: one update moves the tiny model's log-probs by ~1e-2 (scripts/bench_canary.py), far above the
# float32 threshold 1e-3, while a healthy step stays at round-off (~1e-6).
STEPS = ["train.total_steps=6", "ckpt.every=0", "optim.lr=1e-2", "eval.every=0"]


def run(args: list[str], monkeypatch, fault: str | None, capsys) -> tuple[int, list[dict], str]:
    monkeypatch.setattr(faults, "_injected", {})  # a fresh process's visit counts
    if fault:
        monkeypatch.setenv("RL_FAULT_INJECT", fault)
    else:
        monkeypatch.delenv("RL_FAULT_INJECT", raising=False)
    capsys.readouterr()
    status = rl_runner.main(["--cfg", TESTCFG, *args, *STEPS])
    out_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.output_dir="))
    name = next((a.split("=", 1)[1] for a in args if a.startswith("run.name=")), "testconfig")
    lines = (Path(out_dir) / name / "metrics.jsonl").read_text().splitlines()
    return status, [json.loads(x) for x in lines], capsys.readouterr().err


def assert_stopped(status, metrics, err, run_dir, first_bad: int, stop_steps: int = 3) -> None:
    """Stopped after step first_bad + stop_steps - 1 with exit status 70, that step checkpointed, one line."""
    last = first_bad + stop_steps - 1
    assert status == WEIGHT_STATE_EXIT_CODE, err[-2000:]
    assert [m["step"] for m in metrics] == list(range(1, last + 1))
    assert [s for s, _ in list_checkpoints(run_dir)] == [last]
    assert [m["guard/canary_streak"] for m in metrics][first_bad - 2 :] == [0.0, *range(1, stop_steps + 1)]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: steps {first_bad}-{last}: the trainer-vs-sampler canary"), line
    assert f"checkpoint at step {last} saved" in line and "not sampled from the trained weights" in line


def assert_version_stop(status, metrics, err, run_dir, step: int, sampled: int) -> None:
    """Stopped right after step `step` (1-based), whose batch version `sampled` sampled while the trainer held
    version step - 1: exit status 70, that step checkpointed, the guard's one line."""
    assert status == WEIGHT_STATE_EXIT_CODE, err[-2000:]
    assert [m["step"] for m in metrics] == list(range(1, step + 1))
    assert [s for s, _ in list_checkpoints(run_dir)] == [step]
    assert [m["rollout/policy_version_max"] for m in metrics][-1] == sampled
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(
        f"error: batch {step} was sampled by policy versions {sampled}..{sampled}, outside [{step - 1}, {step - 1}] "
        f"(rollout.max_async_level=0): the rollouts were not sampled from the trained weights; checkpoint at step "
        f"{step} saved."
    ), line


def test_colocated_engine_skipped_sync_stops_the_run(run_overrides, monkeypatch, capsys, tmp_path):
    args = [*run_overrides, *VLLM]
    status, healthy, err = run([*args, "run.name=healthy"], monkeypatch, None, capsys)
    assert status == 0, err[-2000:]
    print("healthy canary", [m["rollout/logp_diff_mean"] for m in healthy])
    assert all(m["rollout/logp_diff_mean"] < 1e-4 and m["guard/canary_streak"] == 0 for m in healthy)
    # Every completion of step t carries the engine's tag, the trainer's version t - 1 (issue 41, item 3).
    assert all(m["rollout/policy_version_min"] == m["rollout/policy_version_max"] == m["step"] - 1 for m in healthy)
    # Syncs: the build's (1), after step 1 (2), after step 2 (3: skipped from here on, the tag with it). Step 3
    # samples version 1 while the trainer holds version 2: the version check stops the run at once, where the
    # canary alone would have taken 3 steps.
    status, metrics, err = run([*args, "run.name=skipped"], monkeypatch, "vllm.skip_sync@3", capsys)
    print("skipped-sync canary", [m["rollout/logp_diff_mean"] for m in metrics])
    assert_version_stop(status, metrics, err, tmp_path / "runs" / "skipped", step=3, sampled=1)
    assert "vllm.weight_sync=merge" in err and "vllm.sleep_level" in err
    # The steps before the fault are the healthy run's, bit for bit (the guard changes nothing while healthy).
    assert metrics[0]["rollout/reward_mean"] == healthy[0]["rollout/reward_mean"]
    # The fault gone (the sync fixed), the run continues from the checkpoint the guard wrote.
    status, metrics, err = run([*args, "run.name=skipped", "ckpt.resume=latest"], monkeypatch, None, capsys)
    assert status == 0, err[-2000:]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["guard/canary_streak"] == 0 for m in metrics[4:])  # after the resume: healthy again


def test_colocated_engine_stale_adapter_stops_the_run(run_overrides, monkeypatch, capsys, tmp_path):
    args = [*run_overrides, *VLLM, "vllm.weight_sync=lora", "vllm.sleep_level=1", "rollout.canary_stop_steps=2"]
    # Counted after the build's push: the one after step 1 is the first, and the engine keeps serving (and
    # tagging) the build's adapter from there on, so step 2 samples version 0 while the trainer holds 1.
    status, metrics, err = run([*args, "run.name=stale"], monkeypatch, "vllm.stale_adapter@1", capsys)
    print("stale-adapter canary", [m["rollout/logp_diff_mean"] for m in metrics])
    assert_version_stop(status, metrics, err, tmp_path / "runs" / "stale", step=2, sampled=0)
    assert "vllm.weight_sync=lora" in err


def test_canary_stop_steps_zero_only_logs(run_overrides, monkeypatch, capsys):
    args = [*run_overrides, *VLLM, "rollout.canary_stop_steps=0"]
    status, metrics, err = run(args, monkeypatch, "vllm.skip_sync@3", capsys)
    assert status == 0, err[-2000:]
    assert [m["guard/canary_streak"] for m in metrics] == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert metrics[-1]["guard/canary_over_steps"] == 4.0
    assert [m["rollout/policy_version_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # logged, not stopped


def test_server_publishing_stale_weights_stops_the_run(server_overrides, monkeypatch, capsys, tmp_path):
    # Publishes: the build's policy-v0 (1), after step 1 policy-v1 (2: from here on each new name serves the
    # previous adapter's files, so every version is v0's weights). Step 2 is the first sampled from them.
    status, metrics, err = run([*server_overrides, "run.name=stale"], monkeypatch, "server.stale_publish@2", capsys)
    print("stale-publish canary", [m["rollout/logp_diff_mean"] for m in metrics])
    assert_stopped(status, metrics, err, tmp_path / "runs" / "stale", first_bad=2)
    assert [m["rollout/policy_version_max"] for m in metrics] == [0.0, 1.0, 2.0, 3.0]  # the names were right
    assert "server.weight_sync=lora" in err


def test_server_sampling_an_older_version_stops_at_once(server_overrides, monkeypatch, capsys, tmp_path):
    # The backend asks for version t - 1 from step 2 on: outside [t - K, t] with K = 0, no round-off to allow.
    args = [*server_overrides, "run.name=older"]
    status, metrics, err = run(args, monkeypatch, "server.older_version@2", capsys)
    assert status == WEIGHT_STATE_EXIT_CODE, err[-2000:]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [s for s, _ in list_checkpoints(tmp_path / "runs" / "older")] == [2]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(
        "error: batch 2 was sampled by policy versions 0..0, outside [1, 1] (rollout.max_async_level=0): the "
        "rollouts were not sampled from the trained weights; checkpoint at step 2 saved."
    ), line


def restore_base_weights(server, model_dir) -> None:
    """A full-weight run leaves its own weights in the session's server: its base weights again, for the other
    tests."""
    from rl_training.rollout.server_client import ServerClient

    client = ServerClient([server.url], 60.0, 1, 0.2)
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}
    client.request("POST", "/collective_rpc", body, url=0, retry_5xx=False)
    client.request("POST", "/reset_prefix_cache", url=0)
    client.close()


def test_stale_server_stops_at_once(server_overrides, server, warm_model, monkeypatch, capsys, tmp_path):
    # server.weight_sync=full: publishes are the build's (1), after step 1 (2: from here on the server keeps its
    # weights and its tag, as a server whose reload never happened). Step 2's completions carry the server's
    # tag, version 0, while the trainer holds 1: stopped at that step (issue 41, item 3).
    args = [*server_overrides, "server.weight_sync=full", "run.name=stale_full"]
    try:
        status, metrics, err = run(args, monkeypatch, "server.stale_reload@2", capsys)
    finally:
        restore_base_weights(server, warm_model)
    assert_version_stop(status, metrics, err, tmp_path / "runs" / "stale_full", step=2, sampled=0)
    assert "server.weight_sync=full" in err


def test_healthy_server_run_never_trips(server_overrides, monkeypatch, capsys):
    status, metrics, err = run(server_overrides, monkeypatch, None, capsys)
    assert status == 0, err[-2000:]
    print("healthy server canary", [m["rollout/logp_diff_mean"] for m in metrics])
    assert all(m["guard/canary_streak"] == 0 and m["rollout/logp_diff_mean"] < 1e-4 for m in metrics)
    assert [m["rollout/policy_version_max"] for m in metrics] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_healthy_full_weight_server_run_carries_the_servers_tags(
    server_overrides, server, warm_model, monkeypatch, capsys
):
    args = [*server_overrides, "server.weight_sync=full", "train.total_steps=3"]
    try:
        status, metrics, err = run(args, monkeypatch, None, capsys)
    finally:
        restore_base_weights(server, warm_model)
    assert status == 0, err[-2000:]
    assert [m["rollout/policy_version_min"] for m in metrics] == [m["step"] - 1.0 for m in metrics]


@pytest.mark.parametrize("dtype, healthy_max", [("bfloat16", 2e-2)])  # float32 HF: every other runner test
def test_healthy_hf_runs_never_trip(run_overrides, monkeypatch, capsys, dtype, healthy_max):
    # The HF backend samples with the trainer's own model: the canary is generation-vs-forward round-off.
    status, metrics, err = run([*run_overrides, f"model.dtype={dtype}"], monkeypatch, None, capsys)
    assert status == 0, err[-2000:]
    # a step whose groups all got one reward trains no token and logs no canary (train.drop_zero_adv_groups)
    measured = [m["rollout/logp_diff_mean"] for m in metrics if "rollout/logp_diff_mean" in m]
    print(f"healthy hf {dtype} canary", measured)
    assert measured and all(c < healthy_max for c in measured)
    assert all(m["guard/canary_streak"] == 0 for m in metrics)
