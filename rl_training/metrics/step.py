"""Per-step metrics: the step's own Part (base/parts.py: reduced across ranks with every other producer's, once
per optimizer step), then written by rank 0 only.

Every value is computed from global sums (not averages of per-rank averages), and logged under a
namespace: rollout/*, train/*, is/*, reward/*, perf/*, mem/*. The same dict goes to TensorBoard and to
metrics.jsonl.
"""

from __future__ import annotations

import errno
import json
import math
import os
import resource
from pathlib import Path

import torch

from rl_training.algs.common import zero_adv_groups
from rl_training.base import dist, faults
from rl_training.base.errors import UserError
from rl_training.base.parts import Part
from rl_training.base.timer import PhaseTimer
from rl_training.ckpt.store import abandoned_dir
from rl_training.metrics.wandb_log import NullWandb
from rl_training.rollout.base import Rollouts
from rl_training.tasks.base import Scores
from rl_training.train.update import TrainStats


def peak_memory() -> dict[str, float]:
    """Peak RSS of the process so far, and peak CUDA memory since the previous call (once per step: the
    counter is reset here, or it would show the run's maximum forever)."""
    out = {"mem/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        out["mem/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return out


def step_part(
    rollouts: Rollouts,
    scores: Scores,
    advantages: torch.Tensor,
    group_size: int,
    stats: TrainStats,
    timer: PhaseTimer,
    lr: float,
) -> Part:
    """The step's own metrics (rollout/*, train/*, is/*, perf/*, mem/*, reward/*): this rank's sums and maxes,
    and how the global values become the logged ones (base/parts.py). Call it after the step's last timed phase."""
    lengths = [len(c) for c in rollouts.completion_ids]
    r = torch.tensor(scores.rewards, dtype=torch.float64)
    zero_adv = zero_adv_groups(advantages, group_size)
    sums = {
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
        "seqs": stats.sequences,
        "skipped_tok": stats.skipped_tokens,
        "all_tok": sum(rollouts.trainable(i) for i in range(len(rollouts))),
        **{f"corr_{k}": v for k, v in stats.correction.items()},
        # the task's own reward parts and counters (the same names on every rank: Task.part_names)
        **{f"part_{k}": sum(v) for k, v in scores.parts.items()},
        **{f"count_{k}": v for k, v in scores.counts.items()},
    }
    maxes = {
        "len_max": max(lengths),
        "logp_diff_max": stats.logp_absdiff_max,
        "is_ratio_max": stats.is_ratio_max,
        **{f"t_{k}": v for k, v in timer.seconds.items()},
        **peak_memory(),
    }
    phases = list(timer.seconds)

    def finish(sums: dict, maxes: dict, logged: dict) -> dict[str, float]:
        world = dist.world_size()
        n, tok = sums["n"], max(sums["tokens"], 1.0)
        mean = sums["r"] / n
        step_time = sum(maxes[f"t_{k}"] for k in phases)
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
            "is/ratio_mean": sums["is_ratio"] / tok,  # rho = pi_train / pi_rollout on sampled tokens
            "is/ratio_max": maxes["is_ratio_max"],
            # DDP semantics: the step loss is the mean of the ranks' losses (each already / its normaliser).
            "train/loss": sums["loss"] / world / stats.epochs,
            "train/pg_loss": sums["pg_loss"] / world / stats.epochs,
            "train/grad_norm": sums["grad_norm"] / world,  # identical on every rank after the all-reduce
            "train/lr": lr,
            "train/clip_frac": sums["clipped"] / (tok * stats.epochs),
            "train/entropy": sums["entropy"] / tok,
            # the forward/backward work train.drop_zero_adv_groups saved (the groups it skipped are
            # rollout/zero_adv_group_frac when it is on); the metrics over trained tokens above exclude them
            "train/skipped_token_frac": sums["skipped_tok"] / max(sums["all_tok"], 1.0),
            "perf/step_s": step_time,
            "perf/tokens_per_s": sums["len"] / max(step_time, 1e-9),
            "perf/gen_tokens_per_s": sums["len"] / max(maxes.get("t_generate", 0.0), 1e-9),
        }
        if sums["tokens"] > 0:  # the canary over the trained tokens; none when every group was skipped (no forward)
            out["rollout/logp_diff_mean"] = sums["logp_diff"] / tok
            out["rollout/logp_diff_max"] = maxes["logp_diff_max"]
        if stats.kl_measured:  # steps without the reference forward (loss.kl_log_every) log no KL, not a 0
            out["train/kl"] = sums["kl"] / tok
        # the off-policy correction's counts (loss.correction), each over the step's tokens or sequences
        per = {"tokens": tok, "sequences": max(sums["seqs"], 1.0)}
        out.update({f"is/{k}_frac": sums[f"corr_{k}"] / per[stats.correction_units[k]] for k in stats.correction})
        out.update({f"reward/{k}_mean": sums[f"part_{k}"] / n for k in scores.parts})
        out.update({f"reward/{k}": sums[f"count_{k}"] for k in scores.counts})
        out.update({f"perf/{k}_s": maxes[f"t_{k}"] for k in phases})
        out.update({k: v for k, v in maxes.items() if k.startswith("mem/")})
        return out

    return Part(sums, maxes, finish)


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


class MetricsWriteError(UserError, OSError):
    """metrics.jsonl could not take a line (disk full, permission denied); the file holds the earlier lines."""


def read_whole_lines(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and the number of torn lines dropped (a crash mid-write leaves at most
    the last one torn: a line without its newline, or one that is not a JSON object)."""
    records, torn = [], 0
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and "step" in rec:
                records.append(rec)
            else:
                torn += 1
    return records, torn


def rewrite_jsonl(path: Path, records: list[dict]) -> None:
    """Replace `path` by `records`, atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


class MetricsLogger:
    """TensorBoard + metrics.jsonl on rank 0; a null object elsewhere.

    On resume from step s, TensorBoard's purge_step and a rewrite of metrics.jsonl drop whatever the
    interrupted run logged after s, so every step appears once. Each line goes out in one write() on an
    O_APPEND descriptor; a failed write is cut back off, so every line is whole or absent. `sync()` (called
    before each checkpoint) fsyncs, so a checkpoint never covers a step that metrics.jsonl could lose.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, resume_step: int = 0, wandb=None):
        self.enabled = enabled
        self.writer = None
        self.wandb = wandb or NullWandb()  # the same scalars to W&B, when configured (rl_training/metrics/wandb_log.py)
        self.last_step = resume_step
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        if resume_step and self.jsonl.exists():
            records, torn = read_whole_lines(self.jsonl)
            if torn:
                print(f"note: {self.jsonl}: dropped {torn} torn line(s) left by an interrupted write", flush=True)
            rewrite_jsonl(self.jsonl, [r for r in records if r["step"] <= resume_step])
        elif not resume_step:
            set_aside_logs(Path(run_dir))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)
        self._fd = os.open(self.jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in metrics.items():
            if self.writer is not None:
                self.writer.add_scalar(k, v, step)
        self._append((json.dumps({"step": step, **metrics}) + "\n").encode())
        self.wandb.log(step, metrics)
        self.last_step = step

    def _append(self, line: bytes) -> None:
        size = os.fstat(self._fd).st_size
        try:
            if faults.due("metrics.torn_line"):
                os.write(self._fd, line[: len(line) // 2])
                faults.kill()
            if os.write(self._fd, line) != len(line):  # a short write: the file system ran out of space
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            os.ftruncate(self._fd, size)  # never leave a partial line behind
            raise MetricsWriteError(
                e.errno, f"{self.jsonl}: cannot append a line ({e.strerror}); it holds every earlier step"
            ) from None

    def sync(self) -> None:
        """fsync metrics.jsonl (before a checkpoint: the checkpoint must not outlive the lines it covers)."""
        if self.enabled:
            os.fsync(self._fd)
            if self.writer is not None:  # TensorBoard buffers up to 2 minutes; hand its events to the OS too
                self.writer.flush()

    def summary(self, metrics: dict[str, float]) -> None:
        """End-of-run values (e.g. the final upload's outcome) at the last logged step, in TensorBoard only:
        metrics.jsonl keeps exactly one line per step."""
        if self.enabled and self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, self.last_step)
        self.wandb.summary(metrics)

    def custom_scalars(self, layout: dict) -> None:
        """TensorBoard 'Custom Scalars' tab layout (written once per run directory session)."""
        if self.enabled and self.writer is not None:
            self.writer.add_custom_scalars(layout)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.enabled and self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self.writer is not None:
                self.writer.close()
        self.wandb.close()
        self.wandb = NullWandb()  # closed once, even if close() is called again
