"""rollout.allocation: per_prompt in the real runner (probes/allocation.py): the step's budget of B K completions is
spread over its prompts by their reward history, its groups differ in size, and a resumed run plans the same. The
advisor's ANOVA reads the unequal groups (probes/anova.py) on the HF backend's run, and resumes exactly too.

The reward is scripted (tests/helpers.py SCRIPTED_REWARDS, TiedOrMixed), so which prompts tie does not depend on
what the model writes: a prompt whose string starts with a-e is graded 0.5 on every completion (a tied group, whose
history then predicts waste), any other 0, 1, 0, 1 by its place in the call's batch (its first round of 2 is [0, 1]:
informative, and its later rounds alternate too)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import FOUR_STEPS, TESTCFG, VLLM, resume_last_steps_match, scripted_reward, straight_run


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_per_prompt_steps_spend_the_budget_in_unequal_groups_and_resume_exactly(
    run_overrides, reverse_data, tmp_path, backend
):
    # Four prompts, two tied (a-e) and two mixed, so every step draws all four (B = 4) and from step 2 on plans
    # from their history alone: a tied prompt's rewards predict waste, a mixed one's do not.
    records = [json.loads(line) for line in (reverse_data / "train.jsonl").read_text().splitlines()]
    tied = [r for r in records if r["question"][0] <= "e"][:2]
    mixed = [r for r in records if r["question"][0] > "e"][:2]
    (tmp_path / "four.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tied + mixed))
    base = [
        *run_overrides,
        f"data.train={tmp_path / 'four.jsonl'}",
        *(VLLM if backend == "vllm" else []),
        scripted_reward(tmp_path, "TiedOrMixed"),
        "rollout.allocation=per_prompt",
        *FOUR_STEPS,
        *(
            ["probe.advisor=true", "probe.unit_every=1", "model.gradient_checkpointing=false"]
            if backend == "hf"
            else []
        ),
    ]
    rows = straight_run(tmp_path / "runs", ["--cfg", TESTCFG, *base])
    assert len(rows) == 4
    B, K = 4, 4  # cfg/testconfig.yaml: the budget is 16 completions a step
    for r in rows:
        assert r["rollout/completions_generated"] == r["rollout/completions_trained"] == B * K
        used = r["rollout/alloc_prompts_used"]
        assert r["rollout/alloc_group_size_mean"] == pytest.approx(B * K / used)
        assert 2 <= r["rollout/alloc_group_size_max"] <= 2 * K  # rollout.allocation_k_max 0: 2 x group_size
    # every prompt is new at step 1: a first round of 2 each (8 of the 16), then the plan
    assert rows[0]["rollout/alloc_first_completions"] == 2 * B
    assert rows[0]["rollout/zero_adv_group_frac"] == 0.5  # the two tied groups of four
    # From step 2 every prompt is seen: no first round, and the tied prompts' histories (0.5 every time) predict
    # waste, so they get fewer completions or none (measured: 3 prompts in groups of 6, 6 and 4 at steps 2-3; by
    # step 4 a tied prompt's 6+ equal rewards give w(k) >= (7/8)^k and both sit out: the mixed two get 8 each).
    for r in rows[1:]:
        assert r["rollout/alloc_first_completions"] == 0 and r["rollout/alloc_prompts_used"] < B
        assert r["rollout/zero_adv_group_frac"] < 0.5
    assert any(r["rollout/alloc_group_size_max"] > r["rollout/alloc_group_size_mean"] for r in rows)  # unequal
    assert rows[3]["rollout/alloc_prompts_used"] == 2 and rows[3]["rollout/zero_adv_group_frac"] == 0
    if backend == "hf":  # every step's informative groups (2 or 3, of unequal sizes) give an estimate
        assert all(r["probe/anova/groups"] >= 2 and r["probe/anova/trace_within_raw"] > 0 for r in rows)

    # from the step-2 checkpoint; the advisor's costs are wall-clock seconds (and so is the advice that reads them)
    timed = ("probe/advisor/cost_", "probe/advisor/k_", "probe/advisor/b_star", "probe/advisor/efficiency",
             "probe/advisor/critical_rollouts", "probe/alert/rollout_split")  # fmt: skip
    resume_last_steps_match(tmp_path / "runs", ["--cfg", TESTCFG, *base], rows, 2, timed)
