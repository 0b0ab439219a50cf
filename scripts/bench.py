"""Benchmark RL steps at fixed settings: median step and phase times, throughput, peak RSS (table + JSON).

    .venv/bin/python scripts/bench.py --cfg cfg/tiny_cpu.yaml [--steps 20 --warmup 3] [--backends hf,vllm]
        [--batches 8,16] [--out bench_results/bench.json] [key=value ...]

Each backend (and batch size) gets its own freshly built run (same seed, same config, a temp output dir) in its
own worker process, and the runs take turns step by step, so a noisy shared machine slows them alike; compare the
ratios. The first `--warmup` steps of each are excluded. Overrides apply to every run. `--backends` defaults to
hf,vllm where vllm is installed. One process per run: vLLM's sleep mode allows one engine per process (its CuMem
allocator asserts otherwise), and the peak RSS column is then each run's own.

`--batches B1,B2,...` runs each backend at those rollout.prompts_per_step values and fits the step-time model
step_s = t_f + t_u * B (docs/probes.md 1.6); it prints the probe.step_time_fixed_s / probe.step_time_per_group_s
overrides that let the GNS probe log the goodput-optimal batch probe/gns/b_star.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_run(cfg_path: str, backend: str, overrides: list[str], out_dir: str, name: str):
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.runners.rl_runner import setup

    cfg = load_config(
        cfg_path,
        [
            *overrides,
            f"rollout.backend={backend}",
            f"run.output_dir={out_dir}",
            f"run.name=bench_{name}",
            "run.tensorboard=false",
            "run.progress_bar=false",
        ],
    )
    return setup(cfg, dist.init_distributed())


def summarize(rows: list[dict], n_seq: int) -> dict:
    """Medians over the measured steps of one run; n_seq: completions per step."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
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
        "peak_rss_gb": max(r["mem/peak_rss_gb"] for r in rows),  # the run's own worker process
        "steps_measured": len(rows),
    }


def print_table(results: dict[str, dict], compare: bool = True) -> None:
    cols = list(results)
    keys = list(next(iter(results.values())))
    print(f"{'metric':<22}" + "".join(f"{c:>14}" for c in cols))
    for k in keys:
        print(f"{k:<22}" + "".join(f"{results[c][k]:>14.4g}" for c in cols))
    if compare and len(cols) == 2:
        a, b = cols
        speedup = results[a]["step_s"] / results[b]["step_s"]
        print(f"{b} step speed-up over {a}: {speedup:.2f}x ({a} step time / {b} step time)")


MARK = "@@bench "  # prefix of protocol lines on a worker's stdout (the runner prints its config there too)


def serve(a: argparse.Namespace) -> int:
    """Worker: build one run, then answer each step number read from stdin with that step's perf/mem metrics."""
    run = build_run(a.cfg, a.backend, a.overrides, a.out_dir, a.name)
    c = run.cfg
    prompt_tokens = statistics.mean(len(p) for p in run.prompts)  # of the data set (bench_scaling's token counts)
    send(
        {
            "n_seq": c.rollout.prompts_per_step * c.rollout.group_size,
            "header": describe(c),
            "pid": os.getpid(),
            "prompt_tokens_mean": prompt_tokens,
        }
    )
    try:
        while line := sys.stdin.readline():  # a step number per line; EOF ends the worker
            m = run_step(run, int(line))
            send({k: v for k, v in m.items() if k.startswith(("perf/", "mem/")) or k == "rollout/response_len_mean"})
    finally:
        run.backend.close()
    return 0


def send(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def describe(cfg) -> str:
    r = cfg.rollout
    return (
        f"{r.prompts_per_step} prompts x {r.group_size} completions, {r.max_new_tokens} max new tokens, "
        f"model {cfg.model.name_or_path}"
    )


class Worker:
    """One run in its own process (`bench.py --serve`), driven step by step over its stdin/stdout."""

    def __init__(self, label: str, cmd: list[str]):
        self.label = label
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ready = self.receive()

    def receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"bench: the {self.label} worker exited with status {self.proc.wait()} (stderr above)")

    def step(self, step: int) -> dict:
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        """End the worker (EOF on its stdin); a failure has already surfaced in receive()."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options bench.py shares with bench_scaling.py: config, measured and warm-up steps, backends."""
    ap.add_argument("--cfg", default=str(REPO / "cfg" / "tiny_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default="hf,vllm" if importlib.util.find_spec("vllm") else "hf")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    ap.add_argument("--batches", default="", help="prompts per step to compare, e.g. 8,16 (fits t_f, t_u)")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "bench.json"))
    # internal: what the main process passes to its workers
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def main() -> int:
    a = parse_args()
    if a.serve:
        return serve(a)
    backends = a.backends.split(",")
    batches = [int(x) for x in a.batches.split(",") if x]
    total = a.steps + a.warmup
    plan = {  # label -> (backend, extra overrides)
        (f"{b}@B{n}" if batches else b): (b, [f"rollout.prompts_per_step={n}"] if batches else [])
        for b in backends
        for n in batches or [0]
    }
    with tempfile.TemporaryDirectory() as tmp:
        workers = {}
        try:
            for label, (b, extra) in plan.items():  # one at a time: engine start-ups do not overlap
                overrides = [*a.overrides, *extra, f"train.total_steps={total}"]
                cmd = [sys.executable, __file__, "--serve", "--cfg", a.cfg, "--backend", b, "--out-dir", tmp]
                workers[label] = Worker(label, [*cmd, "--name", label.replace("@", "_"), "--", *overrides])
            rows: dict[str, list[dict]] = {label: [] for label in workers}
            t0 = time.time()
            for step in range(total):
                for label, w in workers.items():  # alternate: every run sees the same machine state
                    m = w.step(step)
                    if step >= a.warmup:
                        rows[label].append(m)
        finally:
            for w in workers.values():
                w.close()
        results = {label: summarize(rows[label], w.ready["n_seq"]) for label, w in workers.items()}
    header = next(iter(workers.values())).ready["header"]
    print(f"\n{a.steps} measured steps per run after {a.warmup} warm-up steps; {header} ({time.time() - t0:.0f} s)")
    print_table(results, compare=not batches)
    step_time = {}
    if len(batches) >= 2:
        from rl_training.probes.gns import fit_step_time

        for b in backends:
            t_f, t_u = fit_step_time(batches, [results[f"{b}@B{n}"]["step_s"] for n in batches])
            step_time[b] = {"t_fixed_s": t_f, "t_per_group_s": t_u}
            if t_f > 0 and t_u > 0:
                print(
                    f"{b}: step_s = {t_f:.4g} + {t_u:.4g} * B  ->  "
                    f"probe.step_time_fixed_s={t_f:.4g} probe.step_time_per_group_s={t_u:.4g}"
                )
            else:
                print(
                    f"{b}: step_s = {t_f:.4g} + {t_u:.4g} * B has a non-positive term: the timing is noise-"
                    "dominated (a busy machine, or batch sizes too close); rerun with more --steps or wider --batches"
                )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": a.cfg,
                "overrides": a.overrides,
                "steps": a.steps,
                "warmup": a.warmup,
                "results": results,
                "step_time_model": step_time,
                "worker_pids": {label: w.ready["pid"] for label, w in workers.items()},
            },
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
