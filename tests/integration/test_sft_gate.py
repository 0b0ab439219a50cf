"""The SFT skill gate (issue 49, item 1; runners/sft_runner.py): with sft.eval_every and sft.stop_when a warm
start stops at the first held-out check that reaches the bar, or runs every step, still writes final_model, says
so in sft_result.json and exits with status 65. The checks' outcome is scripted (a task whose reward is a
constant), so nothing here depends on what the tiny model learns; and the checks change nothing in the training.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from rl_training.base.exit_codes import UNLEARNED_EXIT_CODE
from rl_training.runners import sft_runner
from rl_training.runners.sft_runner import met, parse_conditions
from tests.helpers import REPO, SFT_CFG

# Every greedy completion scores `score`, whatever it says: a check's accuracy is 1.0 or 0.0 by construction.
CONSTANT_TASK = """
from rl_training.tasks import Example, Task


class Constant(Task):
    def __init__(self, score: float):
        self.score = score

    def parse(self, record, where):
        return Example(question=record["question"], reference=record["answer"], solution=record["answer"])

    def reward(self, completion, example):
        return self.score
"""


def _base(tiny_model, reverse_data, tmp_path, score: float) -> list[str]:
    (tmp_path / "constant.py").write_text(CONSTANT_TASK)
    return [
        "--cfg",
        SFT_CFG,
        f"model.name_or_path={tiny_model}",
        f"data.train={reverse_data / 'train.jsonl'}",
        f"data.eval={reverse_data / 'heldout.jsonl'}",
        f"task.name={tmp_path / 'constant.py'}:Constant",
        f"task.args.score={score}",
        "eval.num_prompts=6",  # 3 per rank under torchrun; one process here
        "eval.max_new_tokens=4",
        f"run.output_dir={tmp_path}",
        "sft.schedule=constant",
    ]


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_gate_stops_at_the_first_check_that_reaches_the_bar(tiny_model, reverse_data, tmp_path):
    base = _base(tiny_model, reverse_data, tmp_path, 1.0)
    # the bar equals the accuracy: reaching it passes (>=); checks at 5, 10, ... of 20 steps
    when = "sft.stop_when=[accuracy>=1.0,truncation_rate<=1]"  # both met at the first check
    rc = sft_runner.main([*base, "run.name=pass", "sft.steps=20", "sft.eval_every=5", when])
    assert rc == 0
    run = tmp_path / "pass"
    result = json.loads((run / "sft_result.json").read_text())
    gate = result.pop("gate")
    assert result == {"steps": 5} and gate["metrics"]["accuracy"] == 1.0
    assert {k: v for k, v in gate.items() if k != "metrics"} == {
        "when": ["accuracy>=1", "truncation_rate<=1"],
        "every": 5,
        "passed": True,
        "steps_run": 5,
        "passed_at": 5,
    }
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # it stopped at the check, not at sft.steps
    assert [r.get("eval/accuracy") for r in rows] == [None, None, None, None, 1.0]
    assert sorted(p.name for p in (run / "eval" / "inloop").glob("*.json")) == ["step_000005.json"]
    check = json.loads((run / "eval" / "inloop" / "step_000005.json").read_text())
    assert check["settings"]["num_samples"] == 0 and check["metrics"]["accuracy"] == 1.0  # greedy only
    assert (run / "final_model" / "config.json").exists()


def test_a_gate_never_reached_runs_every_step_keeps_the_model_and_exits_65(tiny_model, reverse_data, tmp_path, capsys):
    base = _base(tiny_model, reverse_data, tmp_path, 0.0)
    rc = sft_runner.main([*base, "run.name=fail", "sft.steps=6", "sft.eval_every=4", "sft.stop_when=[accuracy>=0.5]"])
    assert rc == UNLEARNED_EXIT_CODE == 65
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert len(err) == 1 and "sft.stop_when=['accuracy>=0.5']" in err[0] and "final_model was written" in err[0]
    run = tmp_path / "fail"
    result = json.loads((run / "sft_result.json").read_text())
    assert result == {"steps": 6, "gate": {"when": ["accuracy>=0.5"], "every": 4, "passed": False, "steps_run": 6}}
    # checks at step 4 and at the last step, 6
    assert [r.get("eval/accuracy") for r in _rows(run)] == [None, None, None, 0.0, None, 0.0]
    assert (run / "final_model" / "config.json").exists()  # nothing trained is lost


def test_checks_change_nothing_in_the_training(tiny_model, reverse_data, tmp_path):
    # The checks generate from the model being trained (eval mode, then train mode again) with their own seeds:
    # 6 steps with a check every 2 steps end on the same weights, bit for bit, as 6 steps without.
    base = _base(tiny_model, reverse_data, tmp_path, 0.0)
    assert sft_runner.main([*base, "run.name=plain", "sft.steps=6"]) == 0
    assert sft_runner.main([*base, "run.name=checked", "sft.steps=6", "sft.eval_every=2"]) == 0
    plain = load_file(tmp_path / "plain" / "final_model" / "model.safetensors")
    checked = load_file(tmp_path / "checked" / "final_model" / "model.safetensors")
    assert plain.keys() == checked.keys()
    assert all(plain[k].equal(checked[k]) for k in plain)
    assert [r["sft/loss"] for r in _rows(tmp_path / "plain")] == [r["sft/loss"] for r in _rows(tmp_path / "checked")]
    assert not (tmp_path / "plain" / "sft_result.json").read_text().count("gate")


def test_a_bar_without_checks_is_one_line(tiny_model, reverse_data, tmp_path, capsys):
    base = _base(tiny_model, reverse_data, tmp_path, 1.0)
    assert sft_runner.main([*base, "run.name=nobar", "sft.stop_when=[accuracy>=0.5]"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert err == ["error: sft.stop_when=['accuracy>=0.5'] needs sft.eval_every > 0 (the checks it stops at)"]
    assert not (tmp_path / "nobar").exists()


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("[accuracy>0.5]", "'accuracy>0.5' is not METRIC>=NUMBER or METRIC<=NUMBER"),
        ("[accuracy>=high]", "'accuracy>=high' is not METRIC>=NUMBER"),
        ("[no_such_metric>=0.5]", "sft.stop_when names 'no_such_metric', which the check does not measure: accuracy,"),
    ],
)
def test_a_bad_condition_is_one_line(tiny_model, reverse_data, tmp_path, capsys, when, message):
    # a malformed condition before anything loads; a metric the check lacks at the first check
    base = _base(tiny_model, reverse_data, tmp_path, 1.0)
    assert sft_runner.main([*base, "run.name=bad", "sft.steps=2", "sft.eval_every=1", f"sft.stop_when={when}"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert len(err) == 1 and message in err[0], err


def test_conditions_parse_and_judge():
    conditions = parse_conditions(["accuracy>=0.75", " tool_errors_mean <= 0 ", "loss<=-1e-3"])
    assert conditions == [("accuracy", ">=", 0.75), ("tool_errors_mean", "<=", 0.0), ("loss", "<=", -0.001)]
    assert met(conditions, {"accuracy": 0.75, "tool_errors_mean": 0.0, "loss": -0.001})  # the bars themselves pass
    assert not met(conditions, {"accuracy": 0.74, "tool_errors_mean": 0.0, "loss": -0.001})
    assert not met(conditions, {"accuracy": 0.9, "tool_errors_mean": 0.01, "loss": -0.001})


def test_the_demos_try_the_next_data_order_until_one_passes(tiny_model, reverse_data, tmp_path, monkeypatch):
    # scripts/demo_search.py gated_sft (the tool and search demos' stage 1): order 4 never passes (score 0), order 5
    # does at its first check, so order 6 is never tried; every outcome is reported.
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from demo_search import gated_sft

    def launch(cfg, over):
        return sft_runner.main(["--cfg", cfg, *over, f"task.args.score={float('train.seed=5' in over)}"])

    over = [*_base(tiny_model, reverse_data, tmp_path, 0.0)[2:], "sft.steps=4", "sft.eval_every=2"]
    over += ["sft.stop_when=[accuracy>=0.5]"]
    out, stage1 = gated_sft(launch, SFT_CFG, over, lambda order: tmp_path / f"order{order}", [4, 5, 6])
    assert out == tmp_path / "order5" and (out / "final_model" / "config.json").exists()
    assert stage1 == {
        "order": 5,
        "steps": 2,
        "accuracy": 1.0,
        "tried": [
            {"order": 4, "passed": False, "steps": 4, "best": 0.0},
            {"order": 5, "passed": True, "steps": 2, "best": 1.0},
        ],
    }
    assert not (tmp_path / "order6").exists()
