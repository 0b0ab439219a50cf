"""Dynamic sampling in the real runner (rollout.dynamic_sampling, rollout/refill.py): a step refills its tied groups
with informative ones from newly drawn prompts, counts what that cost, and a resumed run refills the same.

The reward is scripted (tests/helpers.py SCRIPTED_REWARDS, TiedOrMixed), so which groups tie does not depend on
what the model writes: a prompt whose string starts with a-e (of the data's a-j) is graded 0.5 on every completion
(a tied group), any other 0, 1, 0, 1 by its place in the group (informative)."""

from __future__ import annotations

import pytest

from tests.helpers import FOUR_STEPS, TESTCFG, VLLM, resume_last_steps_match, scripted_reward, straight_run


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_refilled_steps_train_informative_groups_count_the_cost_and_resume_exactly(run_overrides, tmp_path, backend):
    base = [
        *run_overrides,
        *(VLLM if backend == "vllm" else []),
        scripted_reward(tmp_path, "TiedOrMixed"),
        "rollout.dynamic_sampling=true",
        *FOUR_STEPS,
    ]
    rows = straight_run(tmp_path / "runs", ["--cfg", TESTCFG, *base])
    assert len(rows) == 4
    for r in rows:
        B, K = 4, 4  # cfg/testconfig.yaml
        assert r["rollout/completions_trained"] == B * K
        assert r["rollout/completions_generated"] == (B + r["rollout/refill_prompts"]) * K
        assert r["rollout/informative_group_frac_trained"] >= r["rollout/informative_group_frac"]
        assert r["rollout/zero_adv_group_frac"] == pytest.approx(1 - r["rollout/informative_group_frac_trained"])
        assert r["rollout/reward_mean"] == 0.5  # tied groups 0.5 each, mixed ones 0, 1, 0, 1
    assert sum(r["rollout/refill_rounds"] for r in rows) > 0  # about half the prompts tie: some step refilled
    assert any(r["rollout/informative_group_frac_trained"] > r["rollout/informative_group_frac"] for r in rows)

    resume_last_steps_match(tmp_path / "runs", ["--cfg", TESTCFG, *base], rows, 2)  # from the step-2 checkpoint
