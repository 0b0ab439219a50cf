"""The reasoning-gym demo's acceptance criteria (issue 42, item 2): `scripts/demo_reasoning_gym.py` end to end
(tiny model created if missing; spell_backward's splits generated from seeds; SFT of the random model on the
dataset's answers; Dr-GRPO + LoRA graded by its score_answer; the same RL with rewards shuffled between problems)
on 128 held-out problems never trained on, greedy:

- the SFT start reaches an accuracy of at least 0.6 from the random model's 0 (measured 0.914 and 0.930, seeds 0
  and 1, 600 SFT steps; 340 steps gave 0.086: the bar sits well past the step where the model learns to copy);
- RL graded by the dataset keeps it: accuracy after RL at least the start's - 0.1 (measured -0.047 and -0.032;
  a flipped advantage or a grader reading the wrong answer loses 0.4 and more, as the ablation does);
- the ablation loses it: the shuffled-reward run's accuracy at least 0.2 below the real run's (measured 0.414
  and 0.789 below: 0.453 vs 0.867, 0.109 vs 0.898), so the real grader's signal, not RL as such, holds it;
- its time is printed (6 minutes on one core), bounded only by the timeout.
RL does not raise the start on this model (docs/extending.md: 200 steps from a start half-way through SFT did
not either); the bars say what the demo shows and no more."""

from __future__ import annotations

import json

import pytest

from tests.helpers import clears, run_demo_script

pytestmark = pytest.mark.slow


@pytest.mark.one_core
def test_reasoning_gym_demo_meets_its_acceptance_criteria(tmp_path):
    r, wall = run_demo_script("demo_reasoning_gym.py", "--output-dir", str(tmp_path))
    (summary_file,) = tmp_path.glob("spell_*_rl/demo_summary.json")
    summary = json.loads(summary_file.read_text())
    acc = {label: m["greedy_accuracy"] for label, m in summary["scores"].items()}
    print("reasoning-gym demo (greedy accuracy):", acc, summary["times"], f"wall {wall:.0f} s")
    assert summary["task"] == "reasoning-gym/spell_backward"
    assert acc["random"] == 0.0 and clears("reasoning-gym: SFT start accuracy", acc["sft"], 0.6), acc
    assert clears("reasoning-gym: RL accuracy - SFT's", acc["rl"] - acc["sft"], -0.1), acc
    assert clears("reasoning-gym: RL accuracy - ablation's", acc["rl"] - acc["shuffled"], 0.2), acc
    assert "shuffled-reward RL" in r.stdout and "SFT start" in r.stdout  # the table is printed
