"""Dynamic sampling in the real runner (rollout.dynamic_sampling, rollout/refill.py): a step refills its tied groups
with informative ones from newly drawn prompts, counts what that cost, and a resumed run refills the same.

The reward is scripted (tests/helpers.py SCRIPTED_REWARDS, TiedOrMixed), so which groups tie does not depend on
what the model writes: a prompt whose string starts with a-e (of the data's a-j) is graded 0.5 on every completion
(a tied group), any other 0, 1, 0, 1 by its place in the group (informative)."""

from __future__ import annotations

import shutil

import pytest

from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, VLLM, read_metrics, scripted_reward


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_refilled_steps_train_informative_groups_count_the_cost_and_resume_exactly(run_overrides, tmp_path, backend):
    base = [
        *run_overrides,
        *(VLLM if backend == "vllm" else []),
        scripted_reward(tmp_path, "TiedOrMixed"),
        "rollout.dynamic_sampling=true",
        "train.total_steps=4",
        "ckpt.every=2",
        "ckpt.keep_last=5",
        "eval.every=0",
    ]
    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=straight"]) == 0
    rows = read_metrics(tmp_path / "runs" / "straight")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        B, K = 4, 4  # cfg/testconfig.yaml
        assert r["rollout/completions_trained"] == B * K
        assert r["rollout/completions_generated"] == (B + r["rollout/refill_prompts"]) * K
        assert r["rollout/informative_group_frac_trained"] >= r["rollout/informative_group_frac"]
        assert r["rollout/zero_adv_group_frac"] == pytest.approx(1 - r["rollout/informative_group_frac_trained"])
        assert r["rollout/reward_mean"] == 0.5  # tied groups 0.5 each, mixed ones 0, 1, 0, 1
    assert sum(r["rollout/refill_rounds"] for r in rows) > 0  # about half the prompts tie: some step refilled
    assert any(r["rollout/informative_group_frac_trained"] > r["rollout/informative_group_frac"] for r in rows)

    out = tmp_path / "runs"
    shutil.copytree(out / "straight", out / "resumed", symlinks=True)
    shutil.rmtree(out / "resumed" / "checkpoints" / "step_000004")
    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=resumed", "ckpt.resume=latest"]) == 0
    again = read_metrics(out / "resumed")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(rows[2:], again[2:], strict=True):
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/")):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)
