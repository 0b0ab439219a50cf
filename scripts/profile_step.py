"""Where one RL step's time goes: cProfile over steps of the bench_trl work, split by the functions that matter.

    python scripts/profile_step.py --backend hf --steps 20            # the short point, probes on
    python scripts/profile_step.py --backend vllm --point long --no-probes
    python scripts/profile_step.py --backend hf --override train.pack_sequences=true

Builds the same run as scripts/bench_trl.py's `ours` rows (same model, data and settings), runs `--warmup`
steps, then profiles `--steps` steps and prints, per named piece of the step, its total seconds per step and
share of the step (cumulative time: a piece includes what it calls), then cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

# (label, where, function name): cumulative time per step of each, from the profile. `where` is a part of the
# file's path: ours by their path from the repository root (tests/integration/test_bench.py checks that each still
# defines the function, so a row cannot silently read 0 s after a move), the libraries' by a path suffix.
PIECES = [
    ("generate (backend)", "rl_training/rollout/", "generate"),
    ("  vLLM LLM.generate", "vllm/entrypoints/llm.py", "generate"),
    ("  HF model.generate", "transformers/generation/utils.py", "generate"),
    ("score_completions", "rl_training/tasks/base.py", "score_completions"),
    ("learner.learn", "rl_training/train/learner.py", "learn"),
    ("make_micro_batches", "rl_training/train/batches.py", "make_micro_batches"),
    ("  pack_sequences", "rl_training/train/packing.py", "pack_sequences"),
    ("train_on_rollouts", "rl_training/train/learner.py", "train_on_rollouts"),
    ("  reference forward (KL)", "rl_training/train/batches.py", "reference_logprobs"),
    ("  forward (policy)", "rl_training/train/batches.py", "forward_logits"),
    ("  token_logprobs fwd", "rl_training/algs/common.py", "forward"),
    ("  token_entropy", "rl_training/algs/common.py", "token_entropy"),
    ("  rollout canary", "rl_training/train/canary.py", "rollout_canary"),
    ("  policy_loss", "rl_training/algs/objectives.py", "policy_loss"),
    ("  backward", "torch/_tensor.py", "backward"),
    ("    unit-probe flush", "rl_training/probes/capture.py", "_flush"),
    ("    micro-probe hook", "rl_training/probes/capture.py", "_hook"),
    ("  probes.observe_rollout", "rl_training/probes/probe.py", "observe_rollout"),
    ("  probes.after_allreduce", "rl_training/probes/probe.py", "after_allreduce"),
    ("  clip_grad_norm_", "torch/nn/utils/clip_grad.py", "clip_grad_norm_"),
    ("  optimizer.step", "torch/optim/optimizer.py", "wrapper"),
    ("  nonfinite check", "rl_training/train/learner.py", "nonfinite"),
    ("sync_weights", "rl_training/rollout/", "sync_weights"),
    ("  merged_hf_weights", "rl_training/policy/models.py", "merged_hf_weights"),
    ("  reload_weights", "vllm/", "reload_weights"),
    ("probes.metrics", "rl_training/probes/probe.py", "metrics"),
    ("step_metrics", "rl_training/runners/rl_runner.py", "step_metrics"),
    ("samples", "rl_training/metrics/samples.py", "__call__"),
]


def piece_seconds(stats: pstats.Stats, suffix: str, func: str) -> float:
    total = 0.0
    for (file, _line, name), (_cc, _nc, _tt, ct, callers) in stats.stats.items():
        if name != func or suffix not in file:
            continue
        # recursion or a wrapper calling the same name: count only calls from outside this function
        if any(c[2] == func and suffix in c[0] for c in callers):
            continue
        total += ct
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--point", default="short")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-probes", action="store_true")
    ap.add_argument("--override", action="append", default=[], help="extra dotted config overrides")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--work", type=Path, default=REPO / "bench_results" / "trl_work")
    a = ap.parse_args(argv)

    import bench_trl
    import torch

    torch.set_num_threads(2)
    spec = bench_trl.POINTS[a.point]
    model, data = bench_trl.prepare(a.work, spec["task"])
    out = a.work / "runs" / f"profile_{a.backend}_{a.point}"
    step = bench_trl.ours(model, data, spec["max_new"], a.backend, not a.no_probes, out, extra=a.override)
    for _ in range(a.warmup):
        step()
    times, phases = [], []
    prof = cProfile.Profile()
    for _ in range(a.steps):
        prof.enable()
        t0 = time.perf_counter()
        _, _, ph = step()
        times.append(time.perf_counter() - t0)
        prof.disable()
        phases.append(ph)
    st = pstats.Stats(prof)
    per_step = sum(times) / a.steps
    print(f"\n{a.backend} {a.point} probes={'off' if a.no_probes else 'on'} {' '.join(a.override)}")
    print(f"step under cProfile: mean {per_step:.4f} s, median {statistics.median(times):.4f} s ({a.steps} steps)")
    print("PhaseTimer medians: " + " ".join(f"{k} {statistics.median(p[k] for p in phases):.4f}" for k in phases[0]))
    print(f"{'piece (cumulative)':<28}{'s/step':>9}{'share':>8}")
    for label, suffix, func in PIECES:
        s = piece_seconds(st, suffix, func) / a.steps
        if s > 0:
            print(f"{label:<28}{s:>9.4f}{s / per_step:>8.1%}")
    print()
    st.sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
