"""The two colocated-vLLM weight-sync modes (vllm.weight_sync = merge | lora) on two model sizes: sync and
generation seconds, side by side.

    python scripts/bench_sync.py [--reps 5] [--sizes tiny,small]

For each model size (tiny: hidden 128 x 4 layers, ~0.8M parameters; small: hidden 512 x 8 layers, ~25M) and
each mode, one worker process builds the bench_trl run (16 prompts x 8, 16 new tokens, LoRA r=8 on every
projection) with rollout.backend=vllm, then alternately with the other mode's worker: perturbs the adapter
(as a training step would), syncs, and generates one rollout batch. Medians of `--reps` rounds. The merge
mode's sync grows with the base model (every targeted weight is merged and reloaded); the lora mode's sync
is an adapter save to tmpfs, paid for by LoRA kernels in every decode step.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
SIZES = {"tiny": {}, "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536}}


def worker(size: str, mode: str, work: Path) -> None:
    import bench_trl
    import torch

    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.rollout.base import SamplingSpec

    torch.set_num_threads(2)
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    _, data = bench_trl.prepare(work, "add")
    model_dir = work / f"sync_{size}"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, seed=0, **SIZES[size])
    step = bench_trl.ours(
        model_dir,
        data,
        16,
        "vllm",
        False,
        work / "runs" / f"sync_{size}_{mode}",
        extra=[f"vllm.weight_sync={mode}", "vllm.sleep_level=1"],
    )
    run = step.run
    prompts = [run.prompts[i] for i in range(16)]
    spec = SamplingSpec(n=8, max_new_tokens=16, temperature=1.0, seed=0)
    g = torch.Generator().manual_seed(0)
    real_stdout.write(json.dumps({"ready": True}) + "\n")
    real_stdout.flush()
    for line in sys.stdin:
        if not line.startswith("run"):
            break
        with torch.no_grad():
            for n, p in run.model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        t0 = time.perf_counter()
        run.backend.sync_weights(run.model)
        t1 = time.perf_counter()
        run.backend.generate(prompts, spec)
        t2 = time.perf_counter()
        real_stdout.write(json.dumps({"sync": t1 - t0, "generate": t2 - t1}) + "\n")
        real_stdout.flush()
    run.backend.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--work", type=Path, default=REPO / "bench_results" / "trl_work")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(*a.worker, a.work)
        return 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    print(f"{'size':<7}{'mode':<7}{'sync s':>9}{'generate s':>12}{'sync+gen':>10}")
    for size in a.sizes.split(","):
        procs = {
            m: subprocess.Popen(
                [sys.executable, __file__, "--worker", size, m, "--work", str(a.work)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(a.work / f"sync_{size}_{m}.log", "w"),
                text=True,
                env=env,
            )
            for m in ("merge", "lora")
        }
        for p in procs.values():
            p.stdout.readline()
        res = {m: [] for m in procs}
        for _ in range(a.reps + 1):  # the first round is a warm-up
            for m, p in procs.items():
                p.stdin.write("run\n")
                p.stdin.flush()
                res[m].append(json.loads(p.stdout.readline()))
        for m, p in procs.items():
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait(timeout=120)
            s = statistics.median(r["sync"] for r in res[m][1:])
            gen = statistics.median(r["generate"] for r in res[m][1:])
            print(f"{size:<7}{m:<7}{s:>9.4f}{gen:>12.4f}{s + gen:>10.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
