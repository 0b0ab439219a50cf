"""The rollout-budget advisor in the real runner (docs/probes.md 9-10): probe.advisor=true adds the unit level,
logs probe/anova/* and probe/advisor/* on the steps the unit level measures, and a resumed run continues the
ANOVA, waste and cost EMAs exactly where the uninterrupted run has them.

The reward is scripted (tests/helpers.py SCRIPTED_REWARDS, TiedOrMixed): which groups tie, and so what the ANOVA
is fed and the waste the advisor measures, follows from the data order alone, not from what the model writes."""

from __future__ import annotations

import math

import pytest

from rl_training.config.load import load_config
from rl_training.runners import rl_runner
from tests.helpers import REPO, read_metrics, scripted_reward, trainer_state

TESTCFG = str(REPO / "cfg" / "testconfig.yaml")
# The HF backend repeats a prompt per completion, so no time is charged to the prompt (c_p = 0): K* then
# depends on the noise and the waste only, not on the measured seconds, and a resumed run must reproduce it.
ADVISED = [
    "probe.advisor=true",
    "probe.unit_every=2",
    "rollout.prompts_per_step=8",
    "train.micro_batch_groups=4",
    "ckpt.every=2",
]
TIMED = ("probe/advisor/cost_rollout_s", "probe/advisor/cost_prompt_s")


def tied_waste(tied: float, K: int = 4) -> float:
    """The step's mean w(K) (probes/advisor.py group_waste, Laplace-smoothed) when a fraction `tied` of its groups
    tie: a tied group of K keeps an unseen second outcome, q = ((K+1)/(K+2), 1/(K+2)); a 0, 1, 0, 1 group has
    q = (3/6, 3/6). w(K) = sum of q^K: at K = 4, 0.483025 and 0.125."""
    w_tied = ((K + 1) / (K + 2)) ** K + (1 / (K + 2)) ** K
    w_mixed = 2 * 0.5**K
    return tied * w_tied + (1 - tied) * w_mixed


def advice(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(("probe/anova/", "probe/advisor/")) and k not in TIMED}


def test_the_advice_is_logged_at_the_unit_cadence_and_resumes_exactly(run_overrides, tmp_path):
    full = [*run_overrides, *ADVISED, scripted_reward(tmp_path, "TiedOrMixed"), "train.total_steps=6"]
    assert rl_runner.main(["--cfg", TESTCFG, *full]) == 0
    rows = read_metrics(tmp_path / "runs" / "testconfig")
    # unit_every=2: the unit level measures on steps 0, 2, 4 (0-based), logged as steps 1, 3, 5
    measured = [r for r in rows if "probe/advisor/k_star" in r]
    assert [r["step"] for r in measured] == [1, 3, 5]
    last = rows[4]
    assert last["probe/advisor/k_current"] == 4 and last["probe/gns/batch_units"] == 8
    # the ANOVA is fed the step's informative groups (the 0, 1, 0, 1 ones), the tied ones left out
    mixed = 8 * (1 - last["rollout/zero_adv_group_frac"])
    assert last["probe/anova/groups"] == pytest.approx(mixed) and mixed >= 2
    assert last["probe/anova/trace_within"] > 0 and last["probe/anova/n_eff"] > 1
    assert last["probe/advisor/cost_prompt_s"] == 0.0 and last["probe/advisor/cost_rollout_s"] > 0
    # the waste the advisor measured: the bias-corrected EMA (updated every step) of steps 1-5's mean w(4)
    beta = load_config(TESTCFG, full).probe.gns_ema_beta
    steps = [tied_waste(r["rollout/zero_adv_group_frac"]) for r in rows[:5]]
    ema = sum(beta ** (4 - j) * (1 - beta) * w for j, w in enumerate(steps)) / (1 - beta**5)
    assert last["probe/advisor/waste_at_k"] == pytest.approx(ema, rel=1e-9)
    # no advice while the between-prompt part is not positive (early steps: it is the weakly measured part)
    between = last["probe/anova/trace_between"]
    no_advice = math.isnan(last["probe/advisor/k_star"])
    assert math.isnan(last["probe/advisor/k_star_no_waste"]) == (between <= 0) == no_advice
    state = trainer_state(tmp_path / "runs" / "testconfig" / "checkpoints" / "step_000006")["probes"]["budget"]
    assert state["anova"]["t"] + state["anova"]["skipped"] == 3  # one update per measured step

    resumed_dir = tmp_path / "resumed"
    part = [*run_overrides, *ADVISED, scripted_reward(tmp_path, "TiedOrMixed"), f"run.output_dir={resumed_dir}"]
    assert rl_runner.main(["--cfg", TESTCFG, *part, "train.total_steps=4"]) == 0
    assert rl_runner.main(["--cfg", TESTCFG, *part, "train.total_steps=6", "ckpt.resume=latest"]) == 0
    again = read_metrics(resumed_dir / "testconfig")
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert advice(again[4]) == pytest.approx(advice(rows[4]), rel=1e-9, nan_ok=True)  # step 5: after the resume
    assert advice(again[4])


def test_the_advisor_is_refused_where_it_cannot_measure(run_overrides, capsys):
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "probe.advisor=true", "probe.enabled=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "probe.advisor=true with probe.enabled=false" in err
    grad_ckpt = ["probe.advisor=true", "model.gradient_checkpointing=true"]
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, *grad_ckpt]) == 2
    assert "per-sequence capture, which a recompute would fire twice" in capsys.readouterr().err
