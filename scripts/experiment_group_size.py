"""How far to trust the rollout-budget advisor (issue 40 item 4, docs/probes.md 10.5): a fixed number of completions
per step split as K completions for each of B = N/K prompts, equal compute, several seeds; held-out reward against
completions spent, and the advisor's recommendation as measured inside the same runs (probe.advisor=true).

    .venv/bin/python scripts/experiment_group_size.py [--ks 2,4,8,16 --completions 64 --seeds 0,1,2 --steps 150]
        [--out runs/k_experiment] [--plot docs/assets/group_size.png] [key=value ...]

The demo's task and model (cfg/tiny_cpu.yaml: string reversal, the tiny Qwen2, vLLM rollouts), one SFT warm start
(cfg/tiny_sft.yaml) shared by every run, then one RL run per (K, seed), the seeds in the outer loop so each K sees
the machine's load alike. Every run: the same learning rate, steps and completions per step (equal generation and
training work up to the per-prompt share), the held-out set (eval.num_prompts greedy) every --eval-every steps.
Prints a table and writes <out>/summary.json; --plot draws held-out reward against completions spent (mean over
seeds, min-max band).

--arms compares ways of spending the budget (issue 52, item 5) instead of the Ks alone, each arm a name:
  k<K>        the fixed split: N/K prompts of K completions;
  dyn:k<K>    the same with rollout.dynamic_sampling (its refills counted as completions spent);
  alloc:k<K>  rollout.allocation: per_prompt over N/K prompts (N completions a step, unequal groups);
  auto:k<K>   rollout.group_size_auto from K: the split follows the advisor at checkpoints (ckpt.every=10).
Completions spent are what each run generated (rollout/completions_generated where logged). The forecast's error at
step 50 (probe/forecast/final_reward against the final evaluation) is reported for every arm.

--task rg:<dataset> runs a reasoning-gym dataset of the survey's (scripts/survey_reasoning_gym.py CANDIDATES:
spell_backward, basic_arithmetic, ...) instead of string reversal: the survey's ungated SFT (600 steps, cosine) as
the shared warm start, then cfg/spell_cpu.yaml's RL with the dataset put in (refills only in the dyn arms).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the reasoning-gym demo's and survey's helpers
EVAL_KEY = "eval/reward_mean"  # greedy held-out mean reward (the demo's headline number)


def sh(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def rg_task(task: str) -> list[str]:
    """The overrides that put reasoning-gym dataset `task` ('rg:<dataset>') into the SFT and RL configs."""
    from demo_reasoning_gym import task_overrides
    from survey_reasoning_gym import CANDIDATES

    found = [c for c in CANDIDATES if c[0] == task.removeprefix("rg:")]
    if not found:
        raise SystemExit(f"--task {task}: one of reverse, {', '.join('rg:' + c[0] for c in CANDIDATES)}")
    return task_overrides(*found[0])


def warm_start(out: Path, task: str) -> Path:
    if task != "reverse":  # the survey's ungated SFT on the dataset
        from demo_reasoning_gym import SURVEY, sft

        model = out / "rg_sft" / "final_model"
        return model if (model / "config.json").exists() else sft("rg", [*SURVEY, *rg_task(task)], str(out))
    model = out / "sft" / "final_model"
    if not (model / "config.json").exists():
        py = sys.executable
        if not (REPO / "models/tiny-qwen2/config.json").exists():
            sh([py, "scripts/make_tiny_model.py", "--out", "models/tiny-qwen2"], out / "make_model.log")
        if not (REPO / "data/reverse/train.jsonl").exists():
            sh([py, "scripts/make_synthetic_data.py", "--out", "data/reverse"], out / "make_data.log")
        cmd = [py, "-m", "rl_training.runners.sft_runner", "--cfg", "cfg/tiny_sft.yaml", f"run.output_dir={out}"]
        sh([*cmd, "run.name=sft"], out / "sft.log")
    return model


ARM_OVERRIDES = {
    "k": [],
    "dyn": ["rollout.dynamic_sampling=true"],
    "alloc": ["rollout.allocation=per_prompt", "probe.advisor=false"],  # the advisor reads equal groups only
    "auto": ["rollout.group_size_auto=true", "ckpt.every=10"],  # it switches at checkpoint boundaries
}


def parse_arm(arm: str) -> tuple[str, int]:
    """'k4' -> ('k', 4); 'dyn:k8' -> ('dyn', 8)."""
    mode, _, k = arm.rpartition(":")
    if not k.startswith("k") or not k[1:].isdigit() or (mode or "k") not in ARM_OVERRIDES:
        raise ValueError(f"arm {arm!r}: k<K>, dyn:k<K>, alloc:k<K> or auto:k<K>")
    return mode or "k", int(k[1:])


def one_run(out: Path, model: Path, arm: str, seed: int, args, extra: list[str]) -> dict:
    mode, k = parse_arm(arm)
    b = args.completions // k
    name = f"{arm.replace(':', '_')}_s{seed}"
    overrides = [
        f"model.name_or_path={model}",
        f"run.output_dir={out}",
        f"run.name={name}",
        "run.progress_bar=false",
        "run.tensorboard=false",
        f"rollout.group_size={k}",
        f"rollout.prompts_per_step={b}",
        f"train.micro_batch_groups={max(1, b // 2)}",  # two micro-batches of N/2 sequences whatever K
        f"train.total_steps={args.steps}",
        f"train.seed={seed}",
        f"eval.every={args.eval_every}",
        "eval.num_samples=0",
        "eval.ks=[]",
        "ckpt.every=0",
        "ckpt.keep_last=1",
        "probe.advisor=true",
        "probe.unit_every=1",
        f"probe.forecast_from={args.forecast_at}",
        *ARM_OVERRIDES[mode],
        *extra,
    ]
    t0 = time.perf_counter()
    rl_cfg, task = ("cfg/tiny_cpu.yaml", []) if args.task == "reverse" else ("cfg/spell_cpu.yaml", rg_task(args.task))
    no_refill = [] if mode == "dyn" else ["rollout.dynamic_sampling=false"]  # cfg/spell_cpu.yaml refills
    overrides = [*task, *no_refill, *overrides]
    cmd = [sys.executable, "-m", "rl_training.runners.rl_runner", "--cfg", rl_cfg, *overrides]
    sh(cmd, out / f"{name}.log")
    rows = rows_of(out / name)
    spent, evals = 0.0, []
    for r in rows:  # group_size_auto: B K of the split (at most the budget)
        split = r.get("rollout/prompts_per_step", b) * r.get("rollout/group_size", k)
        spent += r.get("rollout/completions_generated", split)
        if EVAL_KEY in r:
            evals.append((spent, r[EVAL_KEY]))
    forecast = [
        r["probe/forecast/final_reward"]
        for r in rows
        if r["step"] == args.forecast_at and "probe/forecast/final_reward" in r
    ]
    advice = [r for r in rows if "probe/advisor/k_star" in r] or [{}]
    trusted = [r for r in advice if r.get("probe/advisor/trusted")]
    late = advice[len(advice) // 2 :]  # the second half of the run: the EMA has settled
    finite = lambda xs: [x for x in xs if x == x]  # noqa: E731 - drop NaN
    nan = float("nan")
    return {
        "arm": arm,
        "k": k,
        "b": b,
        "forecast_error": (forecast[0] - evals[-1][1]) if forecast else nan,
        "seed": seed,
        "seconds": time.perf_counter() - t0,
        "evals": evals,
        "final": evals[-1][1],
        "mean_over_evals": statistics.fmean(v for _, v in evals),
        "k_star_late_median": statistics.median(finite([r.get("probe/advisor/k_star", nan) for r in late]) or [nan]),
        "k_star_no_waste_late_median": statistics.median(
            finite([r.get("probe/advisor/k_star_no_waste", nan) for r in late]) or [nan]
        ),
        "k_band_last": (advice[-1].get("probe/advisor/k_lo", nan), advice[-1].get("probe/advisor/k_hi", nan)),
        "efficiency_late_median": statistics.median(
            finite([r.get("probe/advisor/efficiency", nan) for r in late]) or [nan]
        ),
        "ratio_late_median": statistics.median(
            finite([r.get("probe/anova/within_between_ratio", nan) for r in late]) or [nan]
        ),
        "trusted_frac": len(trusted) / max(len(advice), 1),
        "far_steps": sum(int(r.get("probe/alert/rollout_split", 0)) for r in advice),
        "zero_adv_frac": statistics.fmean(r["rollout/zero_adv_group_frac"] for r in rows),
        "waste_model_late": statistics.fmean(r.get("probe/advisor/waste_at_k", nan) for r in late),
        "cost_ratio_late": statistics.fmean(
            r.get("probe/advisor/cost_prompt_s", nan) / r.get("probe/advisor/cost_rollout_s", nan) for r in late
        ),
        "spent": spent,
        "k_final": rows[-1].get("rollout/group_size", k),
        "switches": switches(rows, k),
    }


def switches(rows: list[dict], k: int) -> list[tuple[int, int]]:
    """(step, new K) wherever rollout.group_size_auto changed the split."""
    ks = [(r["step"], r.get("rollout/group_size", k)) for r in rows]
    return [(step, kk) for (_, prev), (step, kk) in itertools.pairwise(ks) if kk != prev]


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def table(results: list[dict], arms: list[str]) -> str:
    head = (
        "arm        K   B   spent/run   final held-out reward   mean over evals        forecast - final      "
        "advisor K* (late)   trS_w/trS_b   trusted   zero-adv (measured / model)   s/run"
    )
    lines = [head, "-" * len(head)]
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        zero = statistics.fmean(r["zero_adv_frac"] for r in rs)
        model = statistics.fmean(r["waste_model_late"] for r in rs)
        lines.append(
            f"{arm:<10} {rs[0]['k']:<3} {rs[0]['b']:<3} {statistics.fmean(r['spent'] for r in rs):<11.0f} "
            f"{spread([r['final'] for r in rs]):<23} {spread([r['mean_over_evals'] for r in rs]):<22} "
            f"{spread([r['forecast_error'] for r in rs]):<21} {spread([r['k_star_late_median'] for r in rs]):<19} "
            f"{spread([r['ratio_late_median'] for r in rs]):<13} "
            f"{statistics.fmean(r['trusted_frac'] for r in rs):<9.2f} {zero:.2f} / {model:.2f}{'':<18} "
            f"{statistics.fmean(r['seconds'] for r in rs):.0f}"
        )
    return "\n".join(lines)


def plot(results: list[dict], arms: list[str], path: Path, completions: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        n = min(len(r["evals"]) for r in rs)
        xs = [statistics.fmean(r["evals"][i][0] for r in rs) for i in range(n)]  # completions generated, mean
        ys = [[r["evals"][i][1] for r in rs] for i in range(n)]
        mean = [statistics.fmean(y) for y in ys]
        ax.plot(xs, mean, marker="o", ms=3, label=f"{arm}, B={rs[0]['b']}")
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15)
    ax.set_xlabel("completions spent")
    ax.set_ylabel("held-out mean reward (greedy)")
    ax.set_title(f"{completions} completions per step as B prompts x K completions ({len(rs)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="2,4,8,16")
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--arms", default="", help="e.g. k4,k8,dyn:k8,alloc:k8 (default: k<K> for each of --ks)")
    ap.add_argument(
        "--forecast-at", type=int, default=50, help="the step whose forecast is scored (probe.forecast_from)"
    )
    ap.add_argument("--task", default="reverse", help="reverse, or rg:<dataset> (a reasoning-gym dataset)")
    ap.add_argument("--out", default="runs/k_experiment")
    ap.add_argument("--plot", default="", help="e.g. docs/assets/group_size.png")
    args, extra = ap.parse_known_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    arms = args.arms.split(",") if args.arms else [f"k{k}" for k in args.ks.split(",")]
    ks = [parse_arm(a)[1] for a in arms]
    bad = [k for k in ks if args.completions % k]
    if bad:
        ap.error(f"--completions {args.completions} is not a multiple of K={bad[0]}")
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RL_CPU_THREADS", "1")
    model = warm_start(out, args.task)
    results = []
    for seed in seeds:
        for arm in arms:
            r = one_run(out, model, arm, seed, args, extra)
            print(f"{arm} seed={seed}: final {r['final']:.3f} after {r['spent']:.0f} completions, advisor K* "
                  f"{r['k_star_late_median']}, switches {r['switches']}, {r['seconds']:.0f} s", flush=True)  # fmt: skip
            results.append(r)
            summary = {"args": vars(args), "extra": extra, "runs": results}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(results, arms))
    if args.plot:
        plot(results, arms, REPO / args.plot, args.completions)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
