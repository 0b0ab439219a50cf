"""rollout.max_async_level > 0 against a real vLLM OpenAI server (the CPU build): a run stopped by the stop
signal with K=2 and resumed gives the metrics of the uninterrupted run (the checkpoint's past adapters are
served again). The K=0 parity with the colocated engine is
tests/integration/test_server_backend.py::test_server_matches_colocated_vllm (its `server_overrides` fixture:
tests/integration/conftest.py, on this module's own server); the demo learning with K=1 is
tests/demos/test_demo.py::test_demo_learns_asynchronously_on_a_vllm_server."""

from __future__ import annotations

import json
import os
import signal

import pytest

from rl_training.base.exit_codes import STOPPED_EXIT_CODE
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, scripted_reward

pytestmark = pytest.mark.slow


@pytest.fixture
def async_overrides(server_overrides):
    return [*server_overrides, "loss.tis_cap=2.0"]


def read(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_k2_equals_the_uninterrupted_run(async_overrides, tmp_path, monkeypatch):
    base = ["--cfg", TESTCFG, *async_overrides, "rollout.max_async_level=2", "train.total_steps=6", "ckpt.every=0"]
    assert rl_runner.main([*base, "run.name=straight"]) == 0
    real_step = rl_runner.rl_step

    def signal_at_step_2(run, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's time-limit warning: checkpoint at step 3, exit 75
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", signal_at_step_2)
    assert rl_runner.main([*base, "run.name=stopped"]) == STOPPED_EXIT_CODE
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main([*base, "run.name=stopped", "ckpt.resume=latest"]) == 0
    straight, resumed = read(tmp_path, "straight"), read(tmp_path, "stopped")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    # batch t from version max(0, t-2), across the resume at step 3 too (versions 1, 2 came from the checkpoint)
    assert [m["rollout/policy_version_max"] for m in resumed] == [0, 0, 0, 1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert a["rollout/policy_version_max"] == b["rollout/policy_version_max"]
        for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm", "is/ratio_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), (a["step"], k)
    # Only batch 0 is on-policy (version 0 = the trainer's weights); from batch 1 on the sampler lags by 1-2
    # updates, which the canary shows far above float round-off
    gaps = [m["rollout/logp_diff_mean"] for m in straight]
    print("K=2 logp_diff_mean per step:", gaps, "is/ratio_mean:", [m["is/ratio_mean"] for m in straight])
    assert gaps[0] < 1e-3 and abs(straight[0]["is/ratio_mean"] - 1) < 1e-3
    assert min(gaps[1:]) > 10 * gaps[0]


def test_dynamic_sampling_under_async_refills_counts_and_resumes(async_overrides, tmp_path, monkeypatch):
    # Issue 52 item 1 on the async queue and the server backend: rollout.dynamic_sampling with K=1. The reward is
    # scripted (tests/helpers.py TiedOrMixed: about half the prompts tie on every completion), so the refills do
    # not depend on what the model writes. The producer thread's batches come from version t-1; a refill is drawn
    # by the main thread from the newest weights. A stop at step 2 and a resume log what the straight run logged.
    base = [
        "--cfg", TESTCFG, *async_overrides, scripted_reward(tmp_path, "TiedOrMixed"), "rollout.max_async_level=1",
        "rollout.dynamic_sampling=true", "train.total_steps=4", "ckpt.every=0", "eval.every=0",
    ]  # fmt: skip
    assert rl_runner.main([*base, "run.name=straight"]) == 0
    straight = read(tmp_path, "straight")
    B, K = 4, 4  # cfg/testconfig.yaml
    for r in straight:
        assert r["rollout/completions_trained"] == B * K
        assert r["rollout/completions_generated"] == (B + r["rollout/refill_prompts"]) * K
        assert r["rollout/informative_group_frac_trained"] >= r["rollout/informative_group_frac"]
    assert sum(r["rollout/refill_rounds"] for r in straight) > 0
    real_step = rl_runner.rl_step

    def signal_at_step_2(run, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", signal_at_step_2)
    assert rl_runner.main([*base, "run.name=stopped"]) == STOPPED_EXIT_CODE
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main([*base, "run.name=stopped", "ckpt.resume=latest"]) == 0
    resumed = read(tmp_path, "stopped")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    keys = ("rollout/refill_prompts", "rollout/completions_generated", "rollout/informative_group_frac_trained",
            "rollout/reward_mean", "train/loss", "train/grad_norm")  # fmt: skip
    for a, b in zip(straight, resumed, strict=True):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), (a["step"], k)
