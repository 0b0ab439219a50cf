"""A task file written outside the repository behaves exactly like a built-in task. The single-turn task and the
multi-turn environment of docs/extending.md, written to a temporary directory and named by task.name, each:
trains 3 steps and resumes to 4 with the metrics of an uninterrupted 4-step run, is evaluated over its
checkpoints by evals.run, and is sampled by synthesize (a multi-turn task writes gold-episode segments); the
same files train on the colocated vLLM engine (slow). A grader that raises or hangs is counted and scored 0
while the run goes on."""

from __future__ import annotations

import json

import pytest

from tests.helpers import MOODY_TASK, TESTCFG, doc_file, read_metrics

SORT_DATA = ["dcab", "hgfe", "jiba", "cfad", "eebd", "gaci", "bbaj", "fedc", "ajic", "hdgb"]
CASES = {
    "sort": (
        "sort_letters.py:SortLetters",
        [{"word": w} for w in SORT_DATA],
        ["data.prompt_template={question}=", "task.args.partial=true"],
    ),
    "guess": (
        "guess_letter.py:GuessLetter",
        [{"secret": s} for s in "abcdefghijabcdef"],
        [
            "data.prompt_template={question}\n",
            "multiturn.max_turns=5",
            "multiturn.max_tokens_per_turn=1",
            "multiturn.max_response_tokens=64",
            "multiturn.max_obs_tokens=16",
        ],
    ),
}


def user_task(case: str, tmp_path, warm_model) -> list[str]:
    """Write the case's task file and data under tmp_path (outside the repository); the runner overrides."""
    spec, rows, extra = CASES[case]
    where = tmp_path / "elsewhere"
    where.mkdir(exist_ok=True)
    (where / spec.split(":")[0]).write_text(doc_file(spec.split(":")[0]))
    data = where / f"{case}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        f"model.name_or_path={warm_model}",
        f"task.name={where / spec}",
        f"data.train={data}",
        f"data.eval={data}",
        f"run.output_dir={tmp_path / 'runs'}",
        *extra,
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_task_trains_resumes_evaluates_and_synthesizes(case, warm_model, tmp_path):
    from evals import run as evals_run
    from rl_training.runners import rl_runner, synthesize

    over = [*user_task(case, tmp_path, warm_model), "ckpt.every=2", "ckpt.keep_last=5"]
    assert rl_runner.main(["--cfg", TESTCFG, *over, "run.name=straight", "train.total_steps=4"]) == 0
    assert rl_runner.main(["--cfg", TESTCFG, *over, "run.name=resumed", "train.total_steps=3"]) == 0
    resume = ["run.name=resumed", "train.total_steps=4", "ckpt.resume=latest"]
    assert rl_runner.main(["--cfg", TESTCFG, *over, *resume]) == 0
    straight, resumed = read_metrics(tmp_path / "runs" / "straight"), read_metrics(tmp_path / "runs" / "resumed")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/")):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)
    assert any(m["train/grad_norm"] > 0 for m in straight)  # the compared runs really trained
    if case == "guess":  # the environment's counts and the engine's per-episode metrics, every step
        assert all({"rollout/guesses_mean", "rollout/found_mean", "rollout/turns_mean"} <= m.keys() for m in resumed)
        assert all(m["rollout/response_len_max"] <= 64 for m in resumed)

    run_dir = tmp_path / "runs" / "resumed"
    args = ["--run-dir", str(run_dir), "--backend", "hf", "--limit", "8", "--n", "2", "--k", "1,2", "--name", "e"]
    assert evals_run.main(args) == 0
    rows = (run_dir / "eval" / "e" / "summary.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "2", "3", "4"]  # the base model and every checkpoint
    step4 = json.loads((run_dir / "eval" / "e" / "step_000004.json").read_text())
    assert step4["settings"]["format"] == over[1].split("=", 1)[1] and step4["num_problems"] == 8

    out = tmp_path / "synth" / f"{case}.jsonl"
    synth = ["--cfg", TESTCFG, "--out", str(out), "--k", "4", "--max-problems", "8", *over]
    assert synthesize.main(synth) == 0
    stats = [json.loads(x) for x in out.with_name(out.name + ".stats.jsonl").read_text().splitlines()]
    assert len(stats) == 8 and all(s["samples"] == 4 for s in stats)
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(kept) == sum(s["kept"] for s in stats)
    if case == "guess":  # gold-episode segments: the sampled text is the answer, observations in between
        for r in kept:
            assert "".join(s["text"] for s in r["segments"] if s["trainable"]) == r["answer"]
            assert all(s["text"] in (" later\n", " earlier\n") for s in r["segments"] if not s["trainable"])


@pytest.mark.slow  # the colocated vLLM engine starts once per case (~20-60 s on 2 cores)
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_task_trains_on_vllm(case, warm_model, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from rl_training.runners import rl_runner

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    over = [*user_task(case, tmp_path, warm_model), "rollout.backend=vllm", "vllm.kv_cache_gb=0.05"]
    assert rl_runner.main(["--cfg", TESTCFG, *over]) == 0
    metrics = read_metrics(tmp_path / "runs" / "testconfig")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # the sampler's log-probs are the trainer's after every sync (the rollouts came from the trained weights)
    assert all(m["rollout/logp_diff_mean"] < 1e-3 for m in metrics)
    if case == "guess":
        assert all(m["rollout/logp_diff_turn1"] < 1e-3 for m in metrics)


def test_user_grader_failures_are_counted_and_the_run_goes_on(warm_model, tmp_path):
    """Four prompts a step (ok, ok, raise, hang) x 4 completions: 4 errors and 4 time-outs per step, each scored
    0, and the run trains on (reward.timeout_s=0.3 bounds each hang)."""
    from rl_training.runners import rl_runner

    (tmp_path / "moody.py").write_text(MOODY_TASK)
    data = tmp_path / "moody.jsonl"
    data.write_text(
        "".join(json.dumps({"q": q, "mode": m}) + "\n" for q, m in zip("abcd", ["ok", "ok", "raise", "hang"]))
    )
    over = [f"model.name_or_path={warm_model}", f"task.name={tmp_path / 'moody.py'}:Moody", f"data.train={data}"]
    over += [f"data.eval={data}", f"run.output_dir={tmp_path / 'runs'}", "train.total_steps=2", "reward.timeout_s=0.3"]
    assert rl_runner.main(["--cfg", TESTCFG, *over]) == 0
    for m in read_metrics(tmp_path / "runs" / "testconfig"):
        assert m["rollout/reward_fn_timeouts"] == 4 and m["rollout/reward_fn_errors"] == 8  # errors + timeouts
        assert m["rollout/reward_mean"] == pytest.approx(0.5 * 8 / 16)  # the two good prompts' 8 completions
