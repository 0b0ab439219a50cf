"""Per-step metrics: the step's rollout, reward, time and memory metrics into its meter (base/meter.py: every
producer's numbers reduced across ranks together, once per optimizer step); metrics/logger.py writes them.

Every value is computed from global sums (not averages of per-rank averages), and logged under a
namespace: rollout/*, train/*, is/*, reward/*, perf/*, mem/*. The same dict goes to TensorBoard and to
metrics.jsonl.
"""

from __future__ import annotations

import resource

import torch

from rl_training.base.meter import Meter
from rl_training.base.timer import PhaseTimer
from rl_training.rollout.base import Rollouts
from rl_training.tasks.base import Scores


def peak_memory() -> dict[str, float]:
    """Peak RSS of the process so far, and peak CUDA memory since the previous call (once per step: the
    counter is reset here, or it would show the run's maximum forever)."""
    out = {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        out["mem/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return out


def measure_step(meter: Meter, rollouts: Rollouts, scores: Scores, timer: PhaseTimer) -> None:
    """The step's rollout and reward metrics, its phase times and peak memory, into the step's meter (base/meter.py)
    under their logged names. Call it after the step's last timed phase."""
    n, lengths = len(rollouts), [len(c) for c in rollouts.completion_ids]
    r = torch.tensor(scores.rewards, dtype=torch.float64)
    meter.mean("rollout/reward_mean", r.sum().item(), per=n)
    meter.std("rollout/reward_std", r)
    meter.mean("rollout/accuracy", sum(scores.correct), per=n)
    meter.mean("rollout/format_rate", sum(scores.formatted), per=n)
    meter.mean("rollout/response_len_mean", sum(lengths), per=n)
    meter.max("rollout/response_len_max", max(lengths))
    meter.mean("rollout/truncation_rate", sum(rollouts.truncated), per=n)
    meter.add("rollout/reward_fn_errors", scores.errors + scores.timeouts + scores.invalid)
    meter.add("rollout/reward_fn_timeouts", scores.timeouts)
    for k, v in scores.parts.items():  # the task's own reward parts and counters (Task.part_names, count_names)
        meter.mean(f"reward/{k}_mean", sum(v), per=n)
    for k, v in scores.counts.items():
        meter.add(f"reward/{k}", v)
    for k, seconds in timer.seconds.items():  # the slowest rank's
        meter.max(f"perf/{k}_s", seconds)
    for k, v in peak_memory().items():
        meter.max(k, v)
    meter.then(lambda logged, totals: throughput(logged, totals["rollout/response_len_mean"], list(timer.seconds)))


def throughput(logged: dict[str, float], tokens: float, phases: list[str]) -> dict[str, float]:
    """perf/step_s (the sum of the phases' slowest-rank times) and the sampled tokens per second of the step and of
    its generate phase; `tokens`: the step's sampled tokens over every rank."""
    step_s = sum(logged[f"perf/{k}_s"] for k in phases)
    return {
        "perf/step_s": step_s,
        "perf/tokens_per_s": tokens / max(step_s, 1e-9),
        "perf/gen_tokens_per_s": tokens / max(logged.get("perf/generate_s", 0.0), 1e-9),
    }
