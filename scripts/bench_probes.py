"""Overhead of the in-loop GNS/ESS probes: one run, probes on and off on alternate steps (table + JSON).

    .venv/bin/python scripts/bench_probes.py --cfg cfg/tiny_cpu.yaml [--steps 40 --warmup 4] [key=value ...]

Alternating inside one run means both conditions see the same machine load, model and data stream. "Off"
steps have every probe hook removed (not merely disarmed; install_hooks() replaces, never adds, a set). Reports
median full-step, train-phase and probe-phase times; the full step includes the probe phase (the ESS/GNS
metric reductions), so the overhead counts every piece of probe work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default=str(REPO / "cfg" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=40, help="measured steps (half on, half off)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "probes.json"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.runners.rl_runner import rl_step, setup

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            a.cfg,
            [
                *a.overrides,
                f"train.total_steps={a.steps + a.warmup}",
                f"run.output_dir={tmp}",
                "run.tensorboard=false",
                "run.progress_bar=false",
                "probe.enabled=true",
            ],
        )
        run = setup(cfg, dist.init_distributed())
        probes = run.probes
        rows = {"on": [], "off": []}
        for step in range(a.steps + a.warmup):
            on = step % 2 == 0
            if on:
                probes.install_hooks()  # idempotent: exactly one set of hooks on "on" steps
                run.probes = probes
            else:
                probes.remove_hooks()
                run.probes = None
            m = rl_step(run, step)
            if step >= a.warmup:
                rows["on" if on else "off"].append((m["perf/step_s"], m["perf/train_s"], m.get("perf/probe_s", 0.0)))
        run.backend.close()
    res = {
        k: {
            "step_s": statistics.median(r[0] for r in v),
            "train_s": statistics.median(r[1] for r in v),
            "probe_s": statistics.median(r[2] for r in v),
            "steps": len(v),
        }
        for k, v in rows.items()
    }
    overhead = res["on"]["step_s"] / res["off"]["step_s"] - 1
    print(
        f"\nprobes overhead, {a.steps} alternating steps after {a.warmup} warm-up; {cfg.rollout.prompts_per_step} "
        f"prompts x {cfg.rollout.group_size}, backend {cfg.rollout.backend}, GNS levels {probes.levels}"
    )
    print(f"{'':<10}{'step_s':>10}{'train_s':>10}{'probe_s':>10}")
    for k in ("off", "on"):
        print(f"{k:<10}{res[k]['step_s']:>10.4f}{res[k]['train_s']:>10.4f}{res[k]['probe_s']:>10.4f}")
    print(f"overhead of the full step: {100 * overhead:+.1f}% (goal: at most +3%)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": a.cfg,
                "overrides": a.overrides,
                "results": res,
                "overhead_frac": overhead,
                "levels": probes.levels,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
