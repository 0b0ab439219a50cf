"""rollout.group_size_auto in the real runner (probes/group_size.py, issue 52 item 3): at checkpoint boundaries the
step's budget of B K completions is split as the advisor says, and a resumed run trains the same splits.

The advice is scripted (the real advisor's costs are wall-clock seconds, so its K* is not a function of the run):
RolloutBudget's advice reads K* = 8 (band 7-9, trusted) while K is 4, and K* = 3 (band 2-3) while K is 8. The
ANOVA, the waste curve and everything else the probes measure are the real ones."""

from __future__ import annotations

import math

from rl_training.probes.budget import RolloutBudget
from tests.helpers import TESTCFG, resume_last_steps_match, straight_run

SCRIPT = {4: (8.0, 7.0, 9.0), 8: (3.0, 2.0, 3.0)}  # K -> the advice's (K*, k_lo, k_hi)


def scripted_advice(real):
    def advice(self) -> dict[str, float]:
        out = {k: math.nan for k in real(self)}  # every advisor tag, none of them from the clock
        k_star, lo, hi = SCRIPT.get(self.K, (math.nan,) * 3)
        trusted = float(self.state.t >= 1)  # trusted from the first update: the switch comes at step 2
        keys = ("k_star", "k_lo", "k_hi", "trusted", "k_current")
        return out | {f"probe/advisor/{k}": v for k, v in zip(keys, (k_star, lo, hi, trusted, self.K), strict=True)}

    return advice


def test_the_split_follows_the_advice_at_checkpoint_boundaries_and_resumes_exactly(
    run_overrides, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(RolloutBudget, "_advice_metrics", scripted_advice(RolloutBudget._advice_metrics))
    argv = [
        "--cfg",
        TESTCFG,
        *run_overrides,
        # B 4 x K 4 = 16 completions a step; one micro-batch group, so B may be 2 (two micro-batches at least)
        "train.micro_batch_groups=1",
        "rollout.group_size_auto=true",
        "probe.advisor=true",
        "probe.unit_every=1",
        "model.gradient_checkpointing=false",
        "train.total_steps=6",
        "ckpt.every=2",
        "ckpt.keep_last=5",
        "eval.every=0",
    ]
    rows = straight_run(tmp_path / "runs", argv)
    # step 2's boundary: K 4 lies outside [7, 9] -> K 8, B 16 / 8 = 2; step 4's: 8 outside [2, 3] -> K 3, B 16 // 3
    # = 5 (15 completions: the normaliser's sequence count follows, tests/unit/runners/test_apply_split.py)
    splits = [(r["rollout/prompts_per_step"], r["rollout/group_size"]) for r in rows]
    assert splits == [(4, 4), (4, 4), (2, 8), (2, 8), (5, 3), (5, 3)]
    out = capsys.readouterr().out
    assert "[step 2] rollout.group_size_auto: group size 4 -> 8, prompts per step 4 -> 2" in out
    assert "[step 4] rollout.group_size_auto: group size 8 -> 3, prompts per step 2 -> 5" in out
    for r in rows:
        assert r["probe/advisor/k_current"] == r["rollout/group_size"]  # the budget reads the new groups
        assert r["probe/gns/batch_units"] == r["rollout/prompts_per_step"]  # and the GNS the new units
    # B_simple is in groups: a switch restarts its EMA (one update at steps 1, 3 and 5), the ANOVA continues
    n_eff = [r["probe/gns/n_eff"] for r in rows]
    assert n_eff[0] == n_eff[2] == n_eff[4] < n_eff[1] == n_eff[3] == n_eff[5]
    anova = [r["probe/anova/n_eff"] for r in rows]
    assert anova == sorted(anova) and anova[0] < anova[2] < anova[4]

    resume_last_steps_match(tmp_path / "runs", argv, rows, 4)  # from the step-4 checkpoint: past both switches
