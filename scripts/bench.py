"""Benchmark RL steps at fixed settings: median step and phase times, throughput, peak RSS (table + JSON).

    .venv/bin/python scripts/bench.py --cfg cfg/tiny_cpu.yaml [--steps 20 --warmup 3] [--backends hf,vllm]
        [--out bench_results/bench.json] [key=value ...]

Each backend gets its own freshly built run (same seed, same config, a temp output dir), and the backends
take turns step by step, so a noisy shared machine slows them alike; compare the ratios. The first
`--warmup` steps of each are excluded. Overrides apply to every backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_run(cfg_path: str, backend: str, overrides: list[str], out_dir: str):
    from rl_training import dist
    from rl_training.config import load_config
    from rl_training.runners.rl_runner import setup

    cfg = load_config(
        cfg_path,
        [
            *overrides,
            f"rollout.backend={backend}",
            f"run.output_dir={out_dir}",
            f"run.name=bench_{backend}",
            "run.tensorboard=false",
            "run.progress_bar=false",
        ],
    )
    return setup(cfg, dist.init_distributed())


def summarize(rows: list[dict], run) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    n_seq = run.cfg.rollout.prompts_per_step * run.cfg.rollout.group_size
    step = med["perf/step_s"]
    return {
        "step_s": step,
        "generate_s": med["perf/generate_s"],
        "score_s": med["perf/score_s"],
        "train_s": med["perf/train_s"],
        "sync_s": med["perf/sync_s"],
        "sync_frac": med["perf/sync_s"] / step,
        "completions_per_s": n_seq / step,
        "gen_tokens_per_s": med["perf/gen_tokens_per_s"],
        "tokens_per_s": med["perf/tokens_per_s"],
        "peak_rss_gb": max(r["mem/peak_rss_gb"] for r in rows),
        "steps_measured": len(rows),
    }


def print_table(results: dict[str, dict]) -> None:
    cols = list(results)
    keys = list(next(iter(results.values())))
    print(f"{'metric':<22}" + "".join(f"{c:>14}" for c in cols))
    for k in keys:
        print(f"{k:<22}" + "".join(f"{results[c][k]:>14.4g}" for c in cols))
    if len(cols) == 2:
        a, b = cols
        speedup = results[a]["step_s"] / results[b]["step_s"]
        print(f"{b} step speed-up over {a}: {speedup:.2f}x ({a} step time / {b} step time)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default=str(REPO / "cfg" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default="hf")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "bench.json"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    backends = a.backends.split(",")
    total = a.steps + a.warmup
    with tempfile.TemporaryDirectory() as tmp:
        runs = {b: build_run(a.cfg, b, [*a.overrides, f"train.total_steps={total}"], tmp) for b in backends}
        rows: dict[str, list[dict]] = {b: [] for b in backends}
        t0 = time.time()
        for step in range(total):
            for b, run in runs.items():  # alternate: both backends see the same machine state
                m = run_step(run, step)
                if step >= a.warmup:
                    rows[b].append({k: v for k, v in m.items() if k.startswith(("perf/", "mem/"))})
        results = {b: summarize(rows[b], runs[b]) for b in backends}
    cfg = next(iter(runs.values())).cfg
    print(
        f"\n{a.steps} measured steps per backend after {a.warmup} warm-up steps; "
        f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} completions, "
        f"{cfg.rollout.max_new_tokens} max new tokens, model {cfg.model.name_or_path} ({time.time() - t0:.0f} s)"
    )
    print_table(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": a.cfg, "overrides": a.overrides, "steps": a.steps, "warmup": a.warmup, "results": results},
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


def run_step(run, step: int) -> dict:
    from rl_training.runners.rl_runner import rl_step

    return rl_step(run, step)


if __name__ == "__main__":
    sys.exit(main())
