"""verifiers v1 environments train, resume and evaluate (docs/verifiers.md), on the environments of tests/vf_envs.py:
a single-turn taskset installed as a package and named by id, on the warm tiny model (2 RL steps, resumed to 3,
`evals.run` over the checkpoints; every sampled reward is v1's grade of that reply), and a multi-turn Env in a file
on the tiny chat model through the episode engine (several turns an episode, every completion graded on its own
episode's trace, resumed and evaluated the same way)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TESTCFG, read_metrics
from tests.vf_envs import HERE, package_dir


def samples(run_dir) -> list[dict]:
    return [json.loads(x) for f in sorted((run_dir / "samples").iterdir()) for x in f.read_text().splitlines()]


def evaluate(run_dir) -> dict:
    from evals import run as evals_run

    args = ["--run-dir", str(run_dir), "--backend", "hf", "--limit", "8", "--n", "2", "--k", "1,2", "--name", "e"]
    assert evals_run.main(args) == 0
    return json.loads((run_dir / "eval" / "e" / "step_000003.json").read_text())


def test_a_taskset_by_id_trains_resumes_and_evaluates_graded_by_its_rewards(warm_model, tmp_path, monkeypatch):
    from rl_training.runners import rl_runner
    from rl_training.tasks.base import score_completions
    from rl_training.tasks.build import make_task

    monkeypatch.syspath_prepend(str(package_dir(tmp_path / "site", "vf-reverse", ["ReverseTaskset"])))
    args = {"taskset": {"num_tasks": 80}, "heldout_size": 16}
    task = ["task.name=verifiers/vf-reverse", f"task.args={json.dumps(args)}", "data.train=task:train"]
    task.append("data.prompt_template={question}=")  # the warm model's format (tests/conftest.py)
    over = [*task, "data.eval=task:heldout", f"model.name_or_path={warm_model}", f"run.output_dir={tmp_path / 'runs'}"]
    over.append("ckpt.every=1")
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=2"]) == 0
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=3", "ckpt.resume=latest"]) == 0
    run_dir = tmp_path / "runs" / "testconfig"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0.0 <= m["reward/reversed_credit_mean"] <= 1.0 for m in metrics)
    # every sampled reward is v1's grade of that reply: the taskset's weighted @vf.reward functions
    vtask = make_task("verifiers/vf-reverse", args)
    by_prompt = {f"{e.question}=": e for e in vtask.examples("train")}
    rows = samples(run_dir)
    assert len(rows) >= 3 and {r["step"] for r in rows} == {1, 2, 3}
    exs = [by_prompt[r["prompt"]] for r in rows]
    assert [r["reward"] for r in rows] == pytest.approx(
        score_completions(vtask, [r["completion"] for r in rows], exs, 5.0).rewards
    )
    assert any(0.0 < r["reward"] for r in rows)  # the warm model reverses in part: RL has signal
    step3 = evaluate(run_dir)
    assert step3["num_problems"] == 8 and step3["settings"]["format"] == "verifiers/vf-reverse"


CHAT = [
    "data.prompt_template={question}",
    "data.use_chat_template=true",
    "data.max_prompt_tokens=64",
    "multiturn.max_turns=4",
    "multiturn.max_tokens_per_turn=8",
    "multiturn.max_response_tokens=160",
    "multiturn.max_obs_tokens=64",
]


def test_a_multi_turn_env_in_a_file_trains_resumes_and_evaluates_on_its_traces(tiny_model, tmp_path):
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.runners import rl_runner

    chat_model = make_tiny_model(tmp_path / "tiny-qwen2-chat", seed=0, chat=True)
    args = {"env": f"{HERE}:GuessEnv", "taskset": {"id": f"{HERE}:GuessTaskset", "num_tasks": 40}, "heldout_size": 8}
    task = ["task.name=verifiers", f"task.args={json.dumps(args)}", "data.train=task:train", "data.eval=task:heldout"]
    over = [*task, *CHAT, f"model.name_or_path={chat_model}", f"run.output_dir={tmp_path / 'runs'}", "ckpt.every=1"]
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=2"]) == 0
    assert rl_runner.main(["--cfg", TESTCFG, *over, "train.total_steps=3", "ckpt.resume=latest"]) == 0
    run_dir = tmp_path / "runs" / "testconfig"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # the random chat model never solves it: each episode runs to the seat's max_turns (3), a stop ending each
    assert all(m["rollout/turns_mean"] > 2.0 and m["rollout/stopped_mean"] > 0.5 for m in metrics), metrics
    assert all(m["reward/untraced"] == 0 for m in metrics)  # every completion graded on its own episode's trace
    # the letters its random replies happen to have (reward `seen`) tell episodes apart: the policy gets gradient
    assert any(m["rollout/zero_adv_group_frac"] < 1.0 and m["train/grad_norm"] > 0.0 for m in metrics), metrics
    rows = samples(run_dir)
    # its grade: solved, credit (.5), seen (.25) and the Env's finalize, 1/turns (.25): between .25 / 3 and 2
    assert rows and all(0.25 / 3 - 1e-9 <= r["reward"] <= 2.0 for r in rows)
    assert {r["episode"]["turns"] for r in rows} == {3} and all(r["episode"]["error"] == "" for r in rows)
    step3 = evaluate(run_dir)
    assert step3["num_problems"] == 8 and step3["settings"]["format"] == "verifiers"
