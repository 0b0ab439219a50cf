"""SmolLM2-135M-Instruct (Q4_1 dequantized) through the commands: RL with its default backend (the colocated vLLM
engine), a resume that reproduces the straight run's metrics, SFT, evals.run with pass@k, and synthesize.

The runs grade with a reward that varies within a sampled group by construction (LengthParity below: the
completion's characters, mod 3, over 2; a step whose 4 groups all tie has probability (1/27)^4), so every step has
non-zero advantages whatever the model happens to answer; the prompts and data are reasoning-gym's (the task of
cfg/smollm2_rl.yaml)."""

from __future__ import annotations

import json
import shutil

import pytest

from rl_training.runners import rl_runner, sft_runner
from tests.helpers import REAL_RL_CFG as RL_CFG
from tests.helpers import REAL_SFT_CFG as SFT_CFG
from tests.helpers import read_metrics

pytestmark = pytest.mark.slow

LENGTH_PARITY = '''
from rl_training.tasks.reasoning_gym import reasoning_gym_task
from rl_training.tasks.base import Task


class LengthParity(Task):
    """reasoning-gym's problems and prompts; reward (characters of the completion mod 3) / 2."""

    def __init__(self, dataset, **args):
        self.inner = reasoning_gym_task(dataset, args)

    def examples(self, split):
        return self.inner.examples(split)

    def render_prompt(self, example, tokenizer, data):
        return self.inner.render_prompt(example, tokenizer, data)

    def reward(self, completion, example):
        return (len(completion) % 3) / 2
'''


@pytest.fixture(scope="module")
def runs(real_model, tmp_path_factory):
    """A straight 3-step run (checkpoints 2 and 3), and a copy of it resumed from checkpoint 2 to step 3."""
    out = tmp_path_factory.mktemp("runs")
    (out / "length_parity.py").write_text(LENGTH_PARITY)
    base = [
        f"model.name_or_path={real_model}",
        f"run.output_dir={out}",
        "run.progress_bar=false",
        f"task.name={out / 'length_parity.py'}:LengthParity",
        "task.args={dataset: basic_arithmetic, size: 64, heldout_size: 8}",
        "data.train=task:train",
        "data.eval=task:heldout",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "train.micro_batch_groups=2",
        "train.total_steps=3",
        "ckpt.every=2",
        "ckpt.keep_last=5",
        "eval.num_samples=4",
        "eval.ks=[1,4]",
        "eval.max_new_tokens=16",
        "probe.lora_health_every=2",
        "optim.warmup_steps=1",
        "optim.schedule=cosine",  # a resume that restarted the schedule would train step 3 at another lr
    ]
    assert rl_runner.main(["--cfg", str(RL_CFG), *base, "run.name=straight"]) == 0
    shutil.copytree(out / "straight", out / "resumed", symlinks=True)  # latest/ and best/ stay links (cp -a)
    shutil.rmtree(out / "resumed" / "checkpoints" / "step_000003")  # as if it had stopped before saving step 3
    assert rl_runner.main(["--cfg", str(RL_CFG), *base, "run.name=resumed", "ckpt.resume=latest"]) == 0
    return out / "straight", out / "resumed", base


def test_resume_reproduces_the_straight_runs_metrics(runs):
    straight, resumed = (read_metrics(d) for d in runs[:2])
    assert [m["step"] for m in straight] == [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert set(a) == set(b)
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/")):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)
    assert all(m["train/grad_norm"] > 0 for m in straight)  # every step trained (the reward varies by construction)
    # warm-up of 1 step, then cosine over the other 2 (train/optimizer.py lr_lambda): x1 at s=0 ((0+1)/1), x1 at s=1
    # (cos 0), x0.5 at s=2 ((1 + cos(pi/2)) / 2); a resume that restarted the schedule would log the peak at step 3
    peak = straight[0]["train/lr"]
    assert [m["train/lr"] for m in straight] == pytest.approx([peak, peak, peak / 2], rel=1e-12)
    assert straight[1]["lora/stable_rank/min"] >= 1  # LoRA health ran on the real model (every 2 steps)
    assert straight[-1]["rollout/logp_diff_mean"] < 1e-3  # the canary, after two syncs of a trained adapter


def test_evals_sft_and_synthesize_run_on_the_real_model(real_model, runs, tmp_path):
    from evals import run as evals_run
    from rl_training.runners import synthesize

    straight, _, base = runs
    # evals.run on every checkpoint and the base model (vLLM), pass@k from 4 samples of each of 8 problems
    assert evals_run.main(["--run-dir", str(straight), "--backend", "vllm", "--limit", "8"]) == 0
    (out,) = (straight / "eval").glob("*heldout*")
    results = {p.name: json.loads(p.read_text()) for p in out.glob("step_*.json")}
    assert sorted(results) == ["step_000000.json", "step_000002.json", "step_000003.json"]
    for r in results.values():
        assert r["num_problems"] == 8 and {"pass@1", "pass@4", "accuracy"} <= set(r["metrics"])
        assert r["metrics"]["pass@4"] >= r["metrics"]["pass@1"]
    # SFT: a LoRA adapter on the answer format, merged into a saved model that loads
    sft = [f"model.name_or_path={real_model}", f"run.output_dir={tmp_path}", "sft.steps=2", "sft.batch_size=4"]
    assert sft_runner.main(["--cfg", str(SFT_CFG), *sft]) == 0
    model = tmp_path / "smollm2_sft" / "final_model"
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    # synthesize: rejection-sampled SFT data from the SFT model, graded by the run's own grader
    synth = tmp_path / "synth.jsonl"
    task = [x for x in base if x.startswith(("task.", "data."))]
    args = ["--cfg", str(RL_CFG), "--out", str(synth), "--k", "4", "--max-problems", "8", *task]
    assert synthesize.main([*args, f"model.name_or_path={model}", "rollout.max_new_tokens=16"]) == 0
    stats = [json.loads(x) for x in synth.with_name(synth.name + ".stats.jsonl").read_text().splitlines()]
    assert len(stats) == 8 and all(s["samples"] == 4 for s in stats)
    kept = [json.loads(x) for x in synth.read_text().splitlines()]
    assert all((len(r["answer"]) % 3) / 2 >= 1.0 for r in kept)  # only what the grader called correct (reward 1)
    shutil.rmtree(model)  # 540 MB
