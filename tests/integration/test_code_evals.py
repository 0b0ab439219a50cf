"""Evals of code tasks: pass@k (the unbiased HumanEval estimator) from sandbox verdicts, through the same
grader and pool as training (rl_training.evaluation.evaluate -> score_completions -> the code Task's batch scorer)."""

from __future__ import annotations

import json

import pytest

from rl_training.data.sources import load_examples
from rl_training.evaluation.evaluate import EvalSettings, evaluate_policy
from rl_training.evaluation.pass_at_k import summarize
from rl_training.policy.models import load_tokenizer
from rl_training.tasks.build import make_task
from tests.helpers import CannedBackend

PROBLEMS = [
    {"task_id": "t/0", "prompt": "def inc(x):\n    '''x + 1'''\n", "entry_point": "inc",
     "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-5) == -4\n"},
    {"task_id": "t/1", "prompt": "def neg(x):\n    '''-x'''\n", "entry_point": "neg",
     "test": "def check(candidate):\n    assert candidate(3) == -3\n"},
]  # fmt: skip


@pytest.fixture
def humaneval_file(tmp_path):
    f = tmp_path / "he.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return f


def test_pass_at_k_of_code_samples(tiny_model, humaneval_file):
    from tests.helpers import require_debian_packages

    require_debian_packages({"bwrap": "bubblewrap"})
    task = make_task("humaneval")
    task.start(None)
    tok = load_tokenizer(str(tiny_model))
    exs = load_examples(str(humaneval_file), task.parse)
    prompts = [tok(ex.question, add_special_tokens=False).input_ids for ex in exs]
    texts = {
        # inc: 2 of 4 samples right (x + 2 fails candidate(1) == 2; while True times out), greedy right
        tuple(prompts[0]): ["    return x + 1\n", "    return x + 2\n", "    return x + 1\n", "    while True: pass\n"],
        # neg: none right (returns x; an object that equals anything cannot cross the boundary)
        tuple(prompts[1]): ["    return x\n", "```python\nclass E:\n    __eq__ = lambda s, o: True\n"
                            "def neg(x):\n    return E()\n```"],
    }  # fmt: skip
    es = EvalSettings(max_new_tokens=8, num_samples=4, ks=(1, 2), temperature=1.0, top_p=1.0, seed=0, timeout_s=2.0)
    records, _ = evaluate_policy(CannedBackend(tok, texts), prompts, exs, task, es)
    assert [r["num_correct"] for r in records] == [2, 0]
    assert [r["greedy"]["correct"] for r in records] == [True, False]
    m = summarize(records, es.ks)
    # pass@1 = mean(2/4, 0) = 0.25; pass@2 = mean(1 - C(2,2)/C(4,2), 0) = mean(1 - 1/6, 0) = 5/12
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@2"] == pytest.approx(5 / 12)
    assert m["accuracy"] == 0.5


@pytest.mark.slow  # about 160 s on 2 busy cores (model loads, torch, two runs)
def test_rl_runner_trains_on_a_code_format(tiny_model, tmp_path):
    """Two RL steps of the real runner on the synthetic program-synthesis task: the sandbox scores every
    rollout and the code metrics reach metrics.jsonl with the names the Task declares."""
    from rl_training.runners import rl_runner
    from rl_training.tasks.code import COUNT_NAMES
    from rl_training.tasks.code.synthetic import write_code_data
    from tests.helpers import require_debian_packages

    require_debian_packages({"bwrap": "bubblewrap"})
    data = write_code_data(tmp_path / "data", n_train=40, n_heldout=8)
    args = [
        "--cfg", "cfg/testconfig.yaml", f"model.name_or_path={tiny_model}", "task.name=humaneval",
        f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'heldout.jsonl'}", "data.prompt_template={question}",
        f"run.output_dir={tmp_path / 'runs'}", "train.total_steps=2", "sandbox.workers=2",
    ]  # fmt: skip
    assert rl_runner.main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "runs" / "testconfig" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        fails = sum(r[f"reward/{k}"] for k in COUNT_NAMES if k.startswith("fail_"))
        # 4 prompts x 4 completions = 16 programs per step, each failing with one class or passing
        assert fails + round(16 * r["reward/pass_frac_mean"]) <= 16 and 0 <= r["reward/pass_frac_mean"] <= 1
        assert r["reward/sandbox_weak"] == 0
    # evals.run on the step-2 checkpoint: pass@k of code samples through the same pool and grader
    from evals import run as evals_run

    run_dir = tmp_path / "runs" / "testconfig"
    opts = ["--run-dir", str(run_dir), "--backend", "hf", "--n", "2", "--k", "1,2", "--max-new-tokens", "8"]
    assert evals_run.main([*opts, "--steps", "2", "--no-base"]) == 0
    res = json.loads((run_dir / "eval" / "data_heldout" / "step_000002.json").read_text())
    assert res["num_problems"] == 8 and 0 <= res["metrics"]["pass@1"] <= res["metrics"]["pass@2"] <= 1
