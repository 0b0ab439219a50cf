"""Per-step metrics: reduced across ranks once per optimizer step, then written by rank 0 only.

Every value is computed from global sums (not averages of per-rank averages), and logged under a
namespace: rollout/*, train/*, perf/*, mem/*. The same dict goes to TensorBoard and to metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rl_training import dist
from rl_training.algs.dr_grpo import zero_adv_groups
from rl_training.checkpoint import abandoned_dir
from rl_training.rewards import Scores
from rl_training.rollout.base import Rollouts
from rl_training.trainer import TrainStats


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def peak_memory() -> dict[str, float]:
    """Peak RSS of the process so far, and peak CUDA memory since the previous call (once per step: the
    counter is reset here, or it would show the run's maximum forever)."""
    out = {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        out["mem/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return out


def step_metrics(
    rollouts: Rollouts,
    scores: Scores,
    advantages: torch.Tensor,
    group_size: int,
    stats: TrainStats,
    timer: PhaseTimer,
    lr: float,
    device: torch.device,
) -> dict[str, float]:
    """Collective (every rank calls it). Returns the global metrics of one step."""
    r = torch.tensor(scores.rewards, dtype=torch.float64)
    lengths = [len(c) for c in rollouts.completion_ids]
    zero_adv = zero_adv_groups(advantages, group_size)
    sums = dist.reduce_sums(
        {
            "n": len(r),
            "r": r.sum().item(),
            "r2": (r * r).sum().item(),
            "correct": sum(scores.correct),
            "formatted": sum(scores.formatted),
            "len": sum(lengths),
            "trunc": sum(rollouts.truncated),
            "zero_adv": zero_adv.sum().item(),
            "groups": zero_adv.numel(),
            "errors": scores.errors,
            "timeouts": scores.timeouts,
            "invalid": scores.invalid,
            "loss": stats.loss,
            "pg_loss": stats.pg_loss,
            "kl": stats.kl_sum,
            "clipped": stats.clipped_tokens,
            "tokens": stats.tokens,
            "entropy": stats.entropy_sum,
            "logp_diff": stats.logp_absdiff_sum,
            "grad_norm": stats.grad_norm,
            "is_ratio": stats.is_ratio_sum,
            "is_trunc": stats.is_truncated,
            # the task's own reward parts and counters (the same names on every rank: Task.part_names)
            **{f"part_{k}": sum(v) for k, v in scores.parts.items()},
            **{f"count_{k}": v for k, v in scores.counts.items()},
        },
        device,
    )
    maxes = dist.reduce_max(
        {
            "len_max": max(lengths),
            "logp_diff_max": stats.logp_absdiff_max,
            "is_ratio_max": stats.is_ratio_max,
            **{f"t_{k}": v for k, v in timer.seconds.items()},
            **peak_memory(),
        },
        device,
    )
    world = dist.world_size()
    n, tok = sums["n"], max(sums["tokens"], 1.0)
    mean = sums["r"] / n
    step_time = sum(maxes[f"t_{k}"] for k in timer.seconds)
    out = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": math.sqrt(max(sums["r2"] / n - mean * mean, 0.0) * n / max(n - 1, 1)),
        "rollout/accuracy": sums["correct"] / n,
        "rollout/format_rate": sums["formatted"] / n,
        "rollout/response_len_mean": sums["len"] / n,
        "rollout/response_len_max": maxes["len_max"],
        "rollout/truncation_rate": sums["trunc"] / n,
        "rollout/zero_adv_group_frac": sums["zero_adv"] / sums["groups"],
        "rollout/reward_fn_errors": sums["errors"] + sums["timeouts"] + sums["invalid"],
        "rollout/reward_fn_timeouts": sums["timeouts"],
        "rollout/logp_diff_mean": sums["logp_diff"] / tok,
        "rollout/logp_diff_max": maxes["logp_diff_max"],
        "is/ratio_mean": sums["is_ratio"] / tok,  # rho = pi_train / pi_rollout on sampled tokens
        "is/ratio_max": maxes["is_ratio_max"],
        "is/trunc_frac": sums["is_trunc"] / tok,
        # DDP semantics: the step loss is the mean of the ranks' losses (each already / its normaliser).
        "train/loss": sums["loss"] / world / stats.epochs,
        "train/pg_loss": sums["pg_loss"] / world / stats.epochs,
        "train/grad_norm": sums["grad_norm"] / world,  # identical on every rank after the all-reduce
        "train/lr": lr,
        "train/clip_frac": sums["clipped"] / (tok * stats.epochs),
        "train/kl": sums["kl"] / tok,
        "train/entropy": sums["entropy"] / tok,
        "perf/step_s": step_time,
        "perf/tokens_per_s": sums["len"] / max(step_time, 1e-9),
        "perf/gen_tokens_per_s": sums["len"] / max(maxes.get("t_generate", 0.0), 1e-9),
    }
    out.update({f"reward/{k}_mean": sums[f"part_{k}"] / n for k in scores.parts})
    out.update({f"reward/{k}": sums[f"count_{k}"] for k in scores.counts})
    out.update({f"perf/{k}_s": maxes[f"t_{k}"] for k in timer.seconds})
    out.update({k: v for k, v in maxes.items() if k.startswith("mem/")})
    return out


def set_aside_logs(run_dir: Path) -> Path | None:
    """A fresh start in a run directory that already has logs (a run that crashed before its first checkpoint,
    or `ckpt.resume=latest` with none complete) moves metrics.jsonl and tb/ into run_dir/abandoned_<time>/
    instead of deleting them or appending a second history to the same TensorBoard steps."""
    old = [p for p in (run_dir / "metrics.jsonl", run_dir / "tb") if p.exists()]
    if not old:
        return None
    dest = abandoned_dir(run_dir)
    for p in old:
        os.replace(p, dest / p.name)
    print(
        f"note: starting {run_dir} afresh: moved its earlier {' and '.join(p.name for p in old)} to {dest}", flush=True
    )
    return dest


class MetricsLogger:
    """TensorBoard + metrics.jsonl on rank 0; a null object elsewhere.

    On resume from step s, TensorBoard's purge_step and a rewrite of metrics.jsonl drop whatever the
    interrupted run logged after s, so every step appears once.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.writer = None
        self.last_step = resume_step
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        if resume_step and self.jsonl.exists():
            keep = [ln for ln in self.jsonl.read_text().splitlines() if json.loads(ln)["step"] <= resume_step]
            tmp = self.jsonl.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            tmp.replace(self.jsonl)
        elif not resume_step:
            set_aside_logs(Path(run_dir))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)
        self._fh = self.jsonl.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in metrics.items():
            if self.writer is not None:
                self.writer.add_scalar(k, v, step)
        self._fh.write(json.dumps({"step": step, **metrics}) + "\n")
        self._fh.flush()
        self.last_step = step

    def summary(self, metrics: dict[str, float]) -> None:
        """End-of-run values (e.g. the final upload's outcome) at the last logged step, in TensorBoard only:
        metrics.jsonl keeps exactly one line per step."""
        if self.enabled and self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, self.last_step)

    def custom_scalars(self, layout: dict) -> None:
        """TensorBoard 'Custom Scalars' tab layout (written once per run directory session)."""
        if self.enabled and self.writer is not None:
            self.writer.add_custom_scalars(layout)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.enabled:
            self._fh.close()
            if self.writer is not None:
                self.writer.close()
