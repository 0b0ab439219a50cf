"""Step time of the colocated engine, the server backend (K=0) and asynchronous server rollouts (K=1), side by
side in one invocation, at the demo's settings and at a long-generation setting (table + JSON).

    flock /tmp/bench.lock .venv/bin/python scripts/bench_async.py [--steps 12 --warmup 3 --rounds 2]
        [--settings demo,long] [--cores 0:1] [--out bench_results/bench_async.json]

Models: a tiny random Qwen2 (created under --work); `long` uses it untrained, so completions run to
max_new_tokens (no early stop token); `demo` uses it after a short SFT warm start (as tests/conftest.py), at
cfg/tiny_cpu.yaml's rollout settings. One CPU vLLM server per setting (the command line of docs/server.md).
`--cores T:S` pins the trainer runs to core T and the server to core S (taskset), so that generation and
training can overlap on a 2-core machine; '' leaves both unpinned.

Each configuration is a whole run of the real runner (async needs its producer thread running across steps, so
runs cannot take turns step by step as in scripts/bench.py); the configurations take turns run by run, for
--rounds rounds, and the medians of perf/step_s over the measured steps of all rounds are compared. Async's
perf/step_s is the main thread's step: waiting for the batch + score + train + publish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {  # name -> rollout overrides; the demo's are cfg/tiny_cpu.yaml's
    "demo": ["rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=12"],
    "long": ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=192"],
}
CONFIGS = {  # label -> overrides
    "colocated": ["rollout.backend=vllm", "vllm.kv_cache_gb=0.25"],
    "server_k0": ["rollout.backend=server", "rollout.max_async_level=0"],
    "server_k1": ["rollout.backend=server", "rollout.max_async_level=1"],
}


def make_models(work: Path) -> dict[str, Path]:
    """{'long': the random tiny model, 'demo': it after 40 SFT steps} and the reversal data, built once."""
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.runners import sft_runner
    from rl_training.tasks.reverse import write_reverse_data

    data = work / "data"
    if not (data / "train.jsonl").exists():
        write_reverse_data(data, n_train=400, n_heldout=32)
    raw = work / "tiny-qwen2"
    if not (raw / "config.json").exists():
        make_tiny_model(raw, seed=0)
    warm = work / "sft" / "warm" / "final_model"
    if not (warm / "config.json").exists():
        args = ["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), f"model.name_or_path={raw}", *data_args(data)]
        args += [f"run.output_dir={work / 'sft'}", "run.name=warm", "sft.steps=40", "sft.warmup_steps=5"]
        assert sft_runner.main(args) == 0
    return {"long": raw, "demo": warm, "data": data}


def data_args(data: Path) -> list[str]:
    return [f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'heldout.jsonl'}"]


def run_once(model: Path, data: Path, out: Path, name: str, overrides: list[str], core: str) -> list[dict]:
    """One whole run in its own process (pinned to `core`); its metrics.jsonl rows."""
    args = [
        "--cfg",
        str(REPO / "cfg" / "tiny_cpu.yaml"),
        f"model.name_or_path={model}",
        *data_args(data),
        f"run.output_dir={out}",
        f"run.name={name}",
        "run.tensorboard=false",
        "run.progress_bar=false",
        "eval.every=0",
        "ckpt.every=0",
        "probe.enabled=false",
        "loss.tis_cap=2.0",
        "lora.r=8",
        "lora.alpha=16",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "rl_training.runners.rl_runner", *args]
    if core:
        cmd = ["taskset", "-c", core, *cmd]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed ({r.returncode}): {r.stderr[-3000:]}")
    return [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]


def _server_class():
    from rl_training.rollout.local_server import VLLMServer  # the command line docs/server.md gives

    class Pinned(VLLMServer):
        core = ""

        def command(self) -> list[str]:
            return ["taskset", "-c", self.core, *super().command()] if self.core else super().command()

    return Pinned


def summarize(rows: list[dict]) -> dict:
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    return {
        "step_s": med("perf/step_s"),
        "generate_or_wait_s": med("perf/generate_s"),
        "train_s": med("perf/train_s"),
        "sync_s": med("perf/sync_s"),
        "producer_wait_s": med("perf/producer_wait_s"),
        "staleness_mean": med("rollout/staleness_mean"),
        "reward_mean": statistics.mean(r["rollout/reward_mean"] for r in rows),
        "steps": len(rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default="demo,long")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cores", default="0:1", help="TRAINER:SERVER cores for taskset; '' = unpinned")
    ap.add_argument("--work", default=str(REPO / "bench_results" / "async_work"))
    ap.add_argument("--out", default=str(REPO / "bench_results" / "bench_async.json"))
    a = ap.parse_args()
    PinnedServer = _server_class()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    models = make_models(work)
    trainer_core, server_core = a.cores.split(":") if a.cores else ("", "")
    load = os.getloadavg()
    results: dict[str, dict[str, dict]] = {}
    t0 = time.time()
    for setting in a.settings.split(","):
        srv = PinnedServer(models[setting], work / f"server-{setting}.log", max_lora_rank=8)
        srv.core = server_core
        srv.start()
        try:
            rows: dict[str, list[dict]] = {c: [] for c in a.configs.split(",")}
            with tempfile.TemporaryDirectory() as tmp:
                for rnd in range(a.rounds):
                    for label in rows:  # configurations take turns: a drifting load hits them alike
                        over = [*SETTINGS[setting], *CONFIGS[label], f"train.total_steps={a.warmup + a.steps}"]
                        over += [f"server.urls=[{srv.url}]", "server.served_model=base"]
                        got = run_once(models[setting], models["data"], Path(tmp), f"{label}_{rnd}", over, trainer_core)
                        rows[label] += got[a.warmup :]
                        print(
                            f"[{setting}] round {rnd} {label}: median step {summarize(got[a.warmup :])['step_s']:.3f} s"
                        )
            results[setting] = {label: summarize(r) for label, r in rows.items()}
        finally:
            srv.stop()
    load_after = os.getloadavg()
    for setting, res in results.items():
        print(f"\n{setting}: {' '.join(SETTINGS[setting])}; {a.rounds} rounds x {a.steps} measured steps per config")
        cols = list(res)
        print(f"{'metric':<20}" + "".join(f"{c:>12}" for c in cols))
        for k in next(iter(res.values())):
            print(f"{k:<20}" + "".join(f"{res[c][k]:>12.4g}" for c in cols))
        if "server_k0" in res and "server_k1" in res:
            print(f"K=1 speed-up over K=0: {res['server_k0']['step_s'] / res['server_k1']['step_s']:.2f}x")
        if "colocated" in res and "server_k1" in res:
            print(f"K=1 speed-up over colocated: {res['colocated']['step_s'] / res['server_k1']['step_s']:.2f}x")
    print(f"\nload average before {load}, after {load_after} (2 cores, shared); {time.time() - t0:.0f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "cores": a.cores, "load_before": load, "load_after": load_after}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
