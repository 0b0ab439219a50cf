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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVAL_KEY = "eval/reward_mean"  # greedy held-out mean reward (the demo's headline number)


def sh(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def warm_start(out: Path) -> Path:
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


def one_run(out: Path, model: Path, k: int, seed: int, args, extra: list[str]) -> dict:
    b = args.completions // k
    name = f"k{k}_s{seed}"
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
        *extra,
    ]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "rl_training.runners.rl_runner", "--cfg", "cfg/tiny_cpu.yaml", *overrides]
    sh(cmd, out / f"{name}.log")
    rows = rows_of(out / name)
    evals = [(r["step"] * args.completions, r[EVAL_KEY]) for r in rows if EVAL_KEY in r]
    advice = [r for r in rows if "probe/advisor/k_star" in r]
    trusted = [r for r in advice if r["probe/advisor/trusted"]]
    late = advice[len(advice) // 2 :]  # the second half of the run: the EMA has settled
    finite = lambda xs: [x for x in xs if x == x]  # noqa: E731 - drop NaN
    return {
        "k": k,
        "b": b,
        "seed": seed,
        "seconds": time.perf_counter() - t0,
        "evals": evals,
        "final": evals[-1][1],
        "mean_over_evals": statistics.fmean(v for _, v in evals),
        "k_star_late_median": statistics.median(finite([r["probe/advisor/k_star"] for r in late]) or [float("nan")]),
        "k_star_no_waste_late_median": statistics.median(
            finite([r["probe/advisor/k_star_no_waste"] for r in late]) or [float("nan")]
        ),
        "k_band_last": (advice[-1]["probe/advisor/k_lo"], advice[-1]["probe/advisor/k_hi"]),
        "efficiency_late_median": statistics.median(
            finite([r["probe/advisor/efficiency"] for r in late]) or [float("nan")]
        ),
        "ratio_late_median": statistics.median(
            finite([r["probe/anova/within_between_ratio"] for r in late]) or [float("nan")]
        ),
        "trusted_frac": len(trusted) / max(len(advice), 1),
        "far_steps": sum(int(r["probe/alert/rollout_split"]) for r in advice),
        "zero_adv_frac": statistics.fmean(r["rollout/zero_adv_group_frac"] for r in rows),
        "waste_model_late": statistics.fmean(r["probe/advisor/waste_at_k"] for r in late),
        "cost_ratio_late": statistics.fmean(
            r["probe/advisor/cost_prompt_s"] / r["probe/advisor/cost_rollout_s"] for r in late
        ),
    }


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def table(results: list[dict], ks: list[int]) -> str:
    head = (
        "K   B   final held-out reward   mean over evals        advisor K* (late)   K* no waste   "
        "trS_w/trS_b   efficiency   trusted   zero-adv (measured / model)   c_p/c_r   s/run"
    )
    lines = [head, "-" * len(head)]
    for k in ks:
        rs = [r for r in results if r["k"] == k]
        zero = statistics.fmean(r["zero_adv_frac"] for r in rs)
        model = statistics.fmean(r["waste_model_late"] for r in rs)
        lines.append(
            f"{k:<3} {rs[0]['b']:<3} {spread([r['final'] for r in rs]):<23} "
            f"{spread([r['mean_over_evals'] for r in rs]):<22} {spread([r['k_star_late_median'] for r in rs]):<19} "
            f"{spread([r['k_star_no_waste_late_median'] for r in rs]):<13} "
            f"{spread([r['ratio_late_median'] for r in rs]):<13} "
            f"{spread([r['efficiency_late_median'] for r in rs]):<12} "
            f"{statistics.fmean(r['trusted_frac'] for r in rs):<9.2f} {zero:.2f} / {model:.2f}{'':<18} "
            f"{statistics.fmean(r['cost_ratio_late'] for r in rs):<9.3g} "
            f"{statistics.fmean(r['seconds'] for r in rs):.0f}"
        )
    return "\n".join(lines)


def plot(results: list[dict], ks: list[int], path: Path, completions: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k in ks:
        rs = [r for r in results if r["k"] == k]
        xs = [x for x, _ in rs[0]["evals"]]
        ys = [[r["evals"][i][1] for r in rs] for i in range(len(xs))]
        mean = [statistics.fmean(y) for y in ys]
        ax.plot(xs, mean, marker="o", ms=3, label=f"K={k}, B={completions // k}")
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15)
    ax.set_xlabel("completions spent")
    ax.set_ylabel("held-out mean reward (greedy)")
    ax.set_title(f"{completions} completions per step split as B prompts x K completions ({len(rs)} seeds)")
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
    ap.add_argument("--out", default="runs/k_experiment")
    ap.add_argument("--plot", default="", help="e.g. docs/assets/group_size.png")
    args, extra = ap.parse_known_args(argv)
    ks, seeds = [int(x) for x in args.ks.split(",")], [int(x) for x in args.seeds.split(",")]
    bad = [k for k in ks if args.completions % k]
    if bad:
        ap.error(f"--completions {args.completions} is not a multiple of K={bad[0]}")
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RL_CPU_THREADS", "1")
    model = warm_start(out)
    results = []
    for seed in seeds:
        for k in ks:
            r = one_run(out, model, k, seed, args, extra)
            print(f"K={k} seed={seed}: final {r['final']:.3f}, advisor K* {r['k_star_late_median']} "
                  f"({r['seconds']:.0f} s)", flush=True)  # fmt: skip
            results.append(r)
            summary = {"args": vars(args), "extra": extra, "runs": results}
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(results, ks))
    if args.plot:
        plot(results, ks, REPO / args.plot, args.completions)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
