"""Overhead of all in-loop probes together (GNS, ESS, LoRA health) against none, side by side (table + JSON).

    .venv/bin/python scripts/bench_probes.py --cfg cfg/tiny_cpu.yaml [--steps 60 --warmup 6 --runs 3] [key=value ...]

Each run (a fresh setup) cycles three conditions step by step, so all see the same machine load, model and data
stream: off (every probe hook removed, not merely disarmed: install_hooks() replaces, never adds, a set; the
learner's and the runner's probes both NullProbes), probes (GNS + ESS, LoRA health off), probes + LoRA health on
that step. Per run: median full-step, train-phase and probe-phase times of each condition; the full step includes
the probe phase (the ESS/GNS reductions and LoRA health), so every piece of probe work counts. "All at the
default" is the GNS + ESS overhead plus one LoRA health call (the probe-phase difference) per
probe.lora_health_every steps. Across runs: the median and the range [min-max].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONDITIONS = ("off", "probes", "probes+lora")


def one_run(cfg_path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.probes.probe import NullProbes
    from rl_training.runners.rl_runner import rl_step, setup

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            cfg_path,
            [
                *overrides,
                f"train.total_steps={steps + warmup}",
                f"run.output_dir={tmp}",
                "run.tensorboard=false",
                "run.progress_bar=false",
                "probe.enabled=true",
            ],
        )
        run = setup(cfg, dist.init_distributed())
        probes, null = run.probes, NullProbes()
        every = run.cfg.probe.lora_health_every
        lora_cfg = {k: dataclasses.replace(run.cfg, probe=dataclasses.replace(run.cfg.probe, lora_health_every=k))
                    for k in (0, 1)}  # fmt: skip
        rows: dict[str, list] = {c: [] for c in CONDITIONS}
        lora_logged = dict.fromkeys(CONDITIONS, 0)  # steps that logged lora/* (the switch works)
        try:
            for step in range(steps + warmup):
                cond = CONDITIONS[step % len(CONDITIONS)]
                if cond == "off":
                    probes.remove_hooks()
                    run.probes = run.learner.probes = null
                else:
                    probes.install_hooks()  # idempotent: exactly one set of hooks
                    run.probes = run.learner.probes = probes
                    run.cfg = lora_cfg[int(cond == "probes+lora")]  # lora_health_every 1: due on this step
                # the learner holds its own reference (its hooks, begin_step): both must switch, or "off" is not
                assert run.learner.probes is run.probes
                m = rl_step(run, step)
                lora_logged[cond] += any(k.startswith("lora/") for k in m)
                if step >= warmup:
                    rows[cond].append((m["perf/step_s"], m["perf/train_s"], m.get("perf/probe_s", 0.0)))
        finally:
            run.rollouts.close()
            run.backend.close()
    res = {
        c: {
            "step_s": statistics.median(r[0] for r in v),
            "train_s": statistics.median(r[1] for r in v),
            "probe_s": statistics.median(r[2] for r in v),
            "steps": len(v),
        }
        for c, v in rows.items()
    }
    off = res["off"]["step_s"]
    lora_call = res["probes+lora"]["probe_s"] - res["probes"]["probe_s"]
    return {
        "results": res,
        "probes_overhead": res["probes"]["step_s"] / off - 1,
        "lora_call_s": lora_call,
        "all_default_overhead": res["probes"]["step_s"] / off - 1 + (lora_call / every / off if every else 0.0),
        "lora_health_every": every,
        "lora_logged": lora_logged,
        "levels": probes.levels,
        "shape": f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}, {run.cfg.rollout.backend}",
    }


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.1%} [{min(xs):+.1%} .. {max(xs):+.1%}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default=str(REPO / "cfg" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=60, help="measured steps per run (a third per condition)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3, help="separate runs (fresh setups), for the spread")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "probes.json"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    runs = [one_run(a.cfg, a.overrides, a.steps, a.warmup) for _ in range(a.runs)]
    r0 = runs[0]
    print(
        f"\nprobe overhead, {a.runs} runs x {a.steps} steps cycling {', '.join(CONDITIONS)} after {a.warmup} "
        f"warm-up; {r0['shape']}, GNS levels {r0['levels']}, LoRA health every {r0['lora_health_every']} steps"
    )
    head = ["run", *(f"{c} step_s" for c in CONDITIONS), "probes", "LoRA call_s", "all at default"]
    print("  ".join(f"{h:>16}" for h in head))
    for i, r in enumerate(runs):
        cells = [str(i + 1), *(f"{r['results'][c]['step_s']:.4f}" for c in CONDITIONS)]
        cells += [f"{r['probes_overhead']:+.1%}", f"{r['lora_call_s']:.4f}", f"{r['all_default_overhead']:+.1%}"]
        print("  ".join(f"{c:>16}" for c in cells))
    print(f"GNS + ESS overhead of the full step: {spread([r['probes_overhead'] for r in runs])} (median [range])")
    print(f"all probes at the default cadence:   {spread([r['all_default_overhead'] for r in runs])} (goal: <= +3%)")
    lora = [r["lora_call_s"] for r in runs]
    print(f"one LoRA health call in the step: {statistics.median(lora) * 1e3:.1f} ms [{min(lora) * 1e3:.1f} .. "
          f"{max(lora) * 1e3:.1f}]")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": a.cfg, "overrides": a.overrides, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
