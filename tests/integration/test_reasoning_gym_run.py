"""A reasoning-gym task by name, with no data files: its generated splits ('task:train', 'task:heldout') serve RL
(2 steps, resumed to 3), evals.run over the checkpoints, synthesize, and SFT on the dataset's answers; the dataset's
own score_answer is the reward of every sample."""

from __future__ import annotations

import json

import pytest

from tests.helpers import SFT_CFG, TESTCFG, read_metrics

TASK = [
    "task.name=reasoning-gym/spell_backward",
    "task.args={max_word_len: 5, size: 64, heldout_size: 16, answer_format: plain}",
    "data.train=task:train",
    "data.eval=task:heldout",
    "data.prompt_template={question}=",  # the warm model's format (tests/conftest.py): the task's own is '{question}'
]


def test_reasoning_gym_trains_resumes_evaluates_synthesizes_and_sfts(warm_model, tmp_path):
    from evals import run as evals_run
    from rl_training.runners import rl_runner, sft_runner, synthesize

    over = [*TASK, f"model.name_or_path={warm_model}", f"run.output_dir={tmp_path / 'runs'}", "ckpt.every=1"]
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=2"]) == 0
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=3", "ckpt.resume=latest"]) == 0
    run_dir = tmp_path / "runs" / "testconfig"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # every sampled reward is spell_backward's score_answer of that completion (partial credit per leading letter)
    from rl_training.tasks.build import make_task

    task = make_task(
        TASK[0].split("=")[1], {"max_word_len": 5, "size": 64, "heldout_size": 16, "answer_format": "plain"}
    )
    by_prompt = {f"{e.question}=": e for e in task.examples("train")}
    rows = [json.loads(x) for f in sorted((run_dir / "samples").iterdir()) for x in f.read_text().splitlines()]
    assert len(rows) >= 3 and {r["step"] for r in rows} == {1, 2, 3}
    for r in rows:
        assert r["reward"] == pytest.approx(task.reward(r["completion"], by_prompt[r["prompt"]]))

    args = ["--run-dir", str(run_dir), "--backend", "hf", "--limit", "8", "--n", "2", "--k", "1,2", "--name", "e"]
    assert evals_run.main(args) == 0
    step3 = json.loads((run_dir / "eval" / "e" / "step_000003.json").read_text())
    assert step3["num_problems"] == 8 and step3["settings"]["format"] == "reasoning-gym/spell_backward"

    out = tmp_path / "synth.jsonl"
    assert synthesize.main(["--cfg", TESTCFG, *over, "--out", str(out), "--k", "2", "--max-problems", "4"]) == 0
    stats = [json.loads(x) for x in out.with_name(out.name + ".stats.jsonl").read_text().splitlines()]
    assert len(stats) == 4

    sft = [*TASK, f"model.name_or_path={warm_model}", f"run.output_dir={tmp_path / 'runs'}", "run.name=sft"]
    assert sft_runner.main(["--cfg", SFT_CFG, *sft, "sft.steps=1", "sft.warmup_steps=0"]) == 0
