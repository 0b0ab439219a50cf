"""What running tools in a process of their own costs (rl_training/sandbox/tool_process.py): the overhead per call,
the start of a process, and the time from a timeout to the next answered call.

    taskset -c 1 python scripts/bench_tool_calls.py                 # 2000 calls x 5 runs, one core
    flock /tmp/bench.lock python scripts/bench_tool_calls.py --calls 5000 --runs 7

- per call: a trivial tool (`add(a, b)`) called --calls times in this process (`result_text(add(**arguments))`,
  what the tool path does besides its time limit) and through ToolProcess.call, the two alternated --runs times
  so both see the same machine load; min / median / max microseconds per call and the median ratio.
- spawn to ready: ToolProcess(...).start(), a fresh interpreter importing the tool (this script, as __mp_main__)
  and rl_training.tasks.tools; --runs times.
- after a timeout: a tool that spins past a 0.2 s limit, then `add`; the kill's cost (the timeout answer's time
  past 0.2 s) and the next call's latency, with the replacement started at the kill (respawn_early) or by the
  next call, the next call coming at once or after a 0.3 s gap (the caller's own work between calls).
Prints a table and the JSON (also written to --out). The load average is printed so a number taken on a busy
machine can be read as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rl_training.sandbox.tool_process import ToolProcess
from rl_training.tasks.tools import result_text

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 0.2
GAP_S = 0.3


def add(a: int, b: int) -> int:
    return a + b


def spin(seconds: float) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "finished"


def us_per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn("add", {"a": i, "b": 1})
    return (time.perf_counter() - t0) / calls * 1e6


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def per_call(calls: int, runs: int) -> dict:
    def direct(name, arguments):
        return result_text(add(**arguments)), ""

    inproc, viaproc = [], []
    with ToolProcess([add], 5.0) as tp:
        tp.call("add", {"a": 0, "b": 0})  # warm: the first call pays the child's first allocations
        for _ in range(runs):
            inproc.append(us_per_call(direct, calls))
            viaproc.append(us_per_call(tp.call, calls))
    return {"in_process_us": spread(inproc), "tool_process_us": spread(viaproc)}


def spawn_to_ready(runs: int) -> dict:
    ms = []
    for _ in range(runs):
        tp = ToolProcess([add], 5.0)
        t0 = time.perf_counter()
        tp.start()
        ms.append((time.perf_counter() - t0) * 1e3)
        tp.close()
    return spread(ms)


def after_timeout(runs: int, respawn_early: bool, gap_s: float) -> dict:
    """The timeout answer's time past TIMEOUT_S (kill and reap) and the next call's latency, in ms."""
    kill, nxt = [], []
    with ToolProcess([add, spin], TIMEOUT_S, respawn_early=respawn_early) as tp:
        for _ in range(runs):
            t0 = time.perf_counter()
            assert tp.call("spin", {"seconds": 10.0})[1] == "timeout"
            kill.append((time.perf_counter() - t0 - TIMEOUT_S) * 1e3)
            time.sleep(gap_s)
            t0 = time.perf_counter()
            assert tp.call("add", {"a": 1, "b": 2}) == ("3", "")
            nxt.append((time.perf_counter() - t0) * 1e3)
    return {"kill_ms": spread(kill), "next_call_ms": spread(nxt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "tool_calls.json"))
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    result = {"calls": a.calls, "runs": a.runs, "cores": len(os.sched_getaffinity(0)), **per_call(a.calls, a.runs)}
    result["ratio_median"] = result["tool_process_us"]["median"] / result["in_process_us"]["median"]
    result["spawn_to_ready_ms"] = spawn_to_ready(a.runs)
    result["after_timeout"] = {
        f"{'early' if early else 'lazy'}_{'gap' if gap else 'at_once'}": after_timeout(a.runs, early, gap)
        for early in (True, False)
        for gap in (0.0, GAP_S)
    }
    result["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]

    def row(label: str, s: dict, unit: str) -> str:
        return f"{label:<44}{s['min']:>10.1f}{s['median']:>10.1f}{s['max']:>10.1f}  {unit}"

    print(f"{'':<44}{'min':>10}{'median':>10}{'max':>10}")
    print(row(f"in process, per call ({a.calls} calls)", result["in_process_us"], "us"))
    print(row("ToolProcess.call, per call", result["tool_process_us"], "us"))
    print(row("spawn to ready", result["spawn_to_ready_ms"], "ms"))
    for k, r in result["after_timeout"].items():
        print(row(f"timeout: kill past {TIMEOUT_S:g} s [{k}]", r["kill_ms"], "ms"))
        print(row(f"timeout: next call [{k}]", r["next_call_ms"], "ms"))
    print(f"ToolProcess / in process (medians): {result['ratio_median']:.0f}x; load average {result['loadavg_1min']}")
    print(json.dumps(result))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
