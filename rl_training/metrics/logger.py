"""The step metrics' writer, on rank 0 only: TensorBoard, metrics.jsonl (whole lines, durable before each checkpoint,
rewound on resume) and W&B when configured."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from rl_training.base import faults
from rl_training.base.errors import UserError
from rl_training.ckpt.store import abandoned_dir
from rl_training.metrics.wandb_log import NullWandb


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
