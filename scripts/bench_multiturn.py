"""Benchmark of the multi-turn rollout step: episodes/s and the share of each turn's generation and of the environment.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_multiturn.py [--cfg cfg/search_cpu.yaml] [--repeats 3]
        [--prompts 16] [key=value ...]

Builds the run's policy and rollout backend exactly as the runner does (rl_runner.setup, so the episode engine,
the retriever and the engine's flags are the training ones), then times `repeats` calls of the step's one
rollout call on `--prompts` prompts x rollout.group_size episodes (seeded, temperature of the config). Prints a
table of medians and one JSON line (the same numbers) for scripts and docs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", default="cfg/search_cpu.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    import bm25s  # noqa: F401  (imported before the engine, as a search run does)

    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.rollout.base import SamplingSpec
    from rl_training.runners import rl_runner

    cfg = load_config(a.cfg, [*a.overrides, "run.name=bench_multiturn", "run.tensorboard=false"])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        rows = []
        for r in range(a.repeats):
            spec = SamplingSpec(cfg.rollout.group_size, 0, cfg.rollout.temperature, cfg.rollout.top_p, seed=1000 + r)
            t0 = time.perf_counter()
            ro = run.backend.generate(run.prompts[: a.prompts], spec, examples=run.examples[: a.prompts])
            total = time.perf_counter() - t0
            eps = ro.episodes or []
            rows.append(
                {
                    "episodes_per_s": len(ro) / total,
                    "total_s": total,
                    "turns_mean": sum(e["turns"] for e in eps) / max(len(eps), 1),
                    **{f"share_{k[:-2]}": v / total for k, v in (ro.timing or {}).items()},
                }
            )
    finally:
        run.backend.close()
        run.task.close()
    keys = sorted({k for row in rows for k in row})
    med = {k: statistics.median(row.get(k, 0.0) for row in rows) for k in keys}
    med.update({"episodes": a.prompts * cfg.rollout.group_size, "backend": cfg.rollout.backend, "repeats": a.repeats})
    print(f"{'measure':<24}{'median':>12}")
    for k in keys:
        print(f"{k:<24}{med[k]:>12.3f}")
    print(json.dumps(med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
