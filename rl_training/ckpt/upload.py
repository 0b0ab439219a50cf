"""Checkpoint upload to S3 (or any rclone remote) in the background, through rclone-python.

    rl_runner.py --cfg ... sync.remote=s3 sync.bucket=my-bucket sync.path=rl     (or RL_SYNC_REMOTE/_BUCKET/_PATH)
    # the remote and its credentials come from the environment only, where rclone itself reads them:
    #   RCLONE_CONFIG_S3_TYPE=s3 RCLONE_CONFIG_S3_PROVIDER=AWS RCLONE_CONFIG_S3_ENV_AUTH=true AWS_ACCESS_KEY_ID=...

After every checkpoint, rank 0 queues `rclone copy <run_dir>/checkpoints/step_N
<remote>:<bucket>/<path>/<run.name>/checkpoints/step_N`. At the end of the run it copies the kept
checkpoints once more (one `rclone copy`, which skips files already there, then each marker), so that one
whose upload had given up lands once the remote works again, waits for it and what is pending (at most
sync.final_timeout_s; after a stop signal at most sync.stop_timeout_s), and uploads the run's logs
(config.yaml, metrics.jsonl, tb/).
A checkpoint goes up in two rclone commands: everything but its `COMPLETE` marker, then, only if that
succeeded, the marker alone. One `rclone copy` transfers files in parallel, so the marker could land
before a file that then fails, and a bucket restored for `ckpt.resume=latest` would offer an incomplete
checkpoint as complete. A failed upload is retried sync.retries times with exponential backoff, then
given up: it is printed to stderr and counted in the `sync/*` metrics (TensorBoard + metrics.jsonl).
Nothing here raises into training.

The uploads run in a helper process (`python -m rl_training.ckpt.upload`), not a thread. SLURM delivers the
time-limit signal to every process of the job step, and rclone-python starts rclone through /bin/sh, which
dies on SIGUSR1 whatever signal mask it inherits: the upload in flight would be reported failed while an
orphaned rclone kept writing. The helper ignores the stop signals before it starts anything, and an ignored
signal stays ignored across exec, so sh and rclone are immune. A stuck upload is abandoned at the end by
killing the helper's process group.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rl_training.ckpt.marker import COMPLETE, STEP_RE
from rl_training.config.schema import SyncCfg

# rclone's own retries off: the helper's backoff is the retry policy (and what the metrics count).
RCLONE_ARGS = ["--retries 1"]
LOGS_FILTER = ["--exclude '/checkpoints/**'"]  # single-quoted: rclone-python hands the line to /bin/sh
FINAL = "final_checkpoints"  # the end-of-run pass over the kept checkpoints


def destination(cfg: SyncCfg, run_name: str) -> str:
    """remote:bucket/path/run_name, skipping empty parts (a local remote's bucket may be an absolute path)."""
    parts = [cfg.bucket.rstrip("/"), cfg.path.strip("/"), run_name]
    return f"{cfg.remote}:" + "/".join(p for p in parts if p)


class NullSyncer:
    """No remote configured, or not rank 0."""

    def submit(self, ckpt: Path) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def drain(self, run_dir: Path, stopped: bool = False) -> dict[str, float]:
        return {}

    def finish(self, run_dir: Path) -> None:
        pass


class CheckpointSyncer:
    """Parent side: queues jobs to the helper process, collects its results, counts, and bounds the end."""

    def __init__(self, cfg: SyncCfg, run_name: str):
        self.dest = destination(cfg, run_name)
        self.wait_s, self.wait_key = cfg.final_timeout_s, "sync.final_timeout_s"
        self.stop_timeout_s = cfg.stop_timeout_s
        self._deadline: float | None = None
        self._cv = threading.Condition()
        self._pending: set[str] = set()  # job names queued or in flight
        self._ok = self._failed = self._skipped = self._retries = 0
        self._last_seconds = 0.0
        self._last_step = 0
        self._logs_ok: bool | None = None  # the end-of-run upload of config.yaml, metrics.jsonl, tb/
        self._final: list[str] = []  # the checkpoints of the end-of-run pass
        self._final_ok: bool | None = None
        cmd = [
            sys.executable,
            "-m",
            "rl_training.ckpt.upload",
            f"--retries={cfg.retries}",
            f"--backoff-s={cfg.backoff_s}",
        ]
        # Own session: the terminal's Ctrl-C and SLURM's step-wide signals are handled by the trainer, and at
        # the end the whole group (helper, sh, rclone) can be stopped at once.
        # The stop signals are ignored from the fork on (an ignored signal stays ignored across exec), not only
        # once the helper's Python has started: a signal in its first second (seen under load) killed it.
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
            preexec_fn=_ignore_stop_signals,  # only signal.signal in the child, before exec
        )
        self._reader = threading.Thread(target=self._read_results, name="ckpt-sync-results", daemon=True)
        self._reader.start()
        print(f"sync: checkpoints will be uploaded to {self.dest}/checkpoints/ in the background", flush=True)

    # ------------------------------------------------------------------------------------------ jobs
    def submit(self, ckpt: Path) -> None:
        ckpt = Path(ckpt).resolve()
        self._send({"name": ckpt.name, "src": str(ckpt), "dst": f"{self.dest}/checkpoints/{ckpt.name}"})

    def _send(self, job: dict) -> None:
        with self._cv:
            self._pending.add(job["name"])
        try:
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the helper is gone (BrokenPipeError) or stdin already closed
            self._record({"name": job["name"], "ok": False, "attempts": 0})
            print(
                f"sync: upload helper is not running (exit {self._proc.poll()}); {job['src']} stays local",
                file=sys.stderr,
            )

    def _read_results(self) -> None:
        for line in self._proc.stdout:
            try:
                self._record(json.loads(line))
            except (ValueError, KeyError):
                print(f"sync: unexpected output from the upload helper: {line.strip()[:200]}", file=sys.stderr)
        with self._cv:  # the helper exited: nothing pending will ever complete
            self._failed += sum(n.startswith("step_") for n in self._pending)
            self._pending.clear()
            self._cv.notify_all()

    def _record(self, r: dict) -> None:
        with self._cv:
            self._pending.discard(r["name"])
            self._retries += max(r.get("attempts", 1) - 1, 0)
            if r["name"].startswith("step_"):
                if r.get("skipped"):
                    self._skipped += 1
                elif r["ok"]:
                    self._ok += 1
                    self._last_seconds = r["seconds"]
                    self._last_step = max(self._last_step, int(r["name"].split("_")[1]))
                else:
                    self._failed += 1
            elif r["name"] == FINAL:
                self._final_ok = r["ok"]
                if r["ok"]:
                    self._last_step = max(self._last_step, *(int(n.split("_")[1]) for n in self._final))
            else:
                self._logs_ok = r["ok"]
            self._cv.notify_all()

    # --------------------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """Counters since this process started (a resumed job starts from 0)."""
        with self._cv:
            final = {} if self._final_ok is None else {"sync/final_ckpts_ok": len(self._final) * self._final_ok}
            return {
                **final,  # after the end-of-run pass: how many kept checkpoints it put on the remote (0: failed)
                "sync/ckpt_uploads_ok": self._ok,
                "sync/ckpt_upload_failures": self._failed,
                "sync/ckpt_upload_retries": self._retries,
                "sync/ckpt_uploads_skipped": self._skipped,
                "sync/ckpt_upload_seconds": self._last_seconds,
                "sync/ckpt_pending": sum(n.startswith("step_") for n in self._pending),
                "sync/last_uploaded_step": self._last_step,
            }

    # ------------------------------------------------------------------------------------ end of run
    def _remaining(self) -> float:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.wait_s
        return max(self._deadline - time.monotonic(), 0.0)

    def drain(self, run_dir: Path, stopped: bool = False) -> dict[str, float]:
        """Queue the end-of-run pass over the kept checkpoints and wait (within sync.final_timeout_s, or
        sync.stop_timeout_s after a stop signal; shared with finish) for it and the queued ones; the metrics."""
        if stopped and self.stop_timeout_s < self.wait_s:
            self.wait_s, self.wait_key = self.stop_timeout_s, "sync.stop_timeout_s"
        root = Path(run_dir).resolve() / "checkpoints"
        kept = sorted(p.name for p in root.glob("step_*") if STEP_RE.fullmatch(p.name) and (p / COMPLETE).is_file())
        if kept:
            self._final = kept
            self._send({"name": FINAL, "src": str(root), "dst": f"{self.dest}/checkpoints", "final": kept})
        with self._cv:
            self._cv.wait_for(lambda: not self._pending, timeout=self._remaining())
        return self.metrics()

    def finish(self, run_dir: Path) -> None:
        """Upload the run's logs, let the helper finish, and abandon whatever is left at the deadline."""
        if self._proc.stdin.closed:
            return
        self._send({"name": "logs", "src": str(Path(run_dir).resolve()), "dst": self.dest, "logs": True})
        try:
            self._proc.stdin.close()  # the helper exits after the last queued job
        except OSError:  # it is already gone; the reader has counted what was pending
            pass
        try:
            self._proc.wait(timeout=self._remaining())
        except subprocess.TimeoutExpired:
            with self._cv:
                left = len(self._pending)
            print(
                f"sync: {left} upload(s) still running after {self.wait_key}={self.wait_s:g}; "
                "abandoned (the files are still local)",
                file=sys.stderr,
                flush=True,
            )
            self._stop_helper()
        except KeyboardInterrupt:
            self._stop_helper()
            raise
        self._reader.join(timeout=5)
        m = self.metrics()
        final = {None: "no final pass", True: f"final pass: all {len(self._final)} kept on the remote"}.get(
            self._final_ok, "final pass failed"
        )
        print(
            f"sync: {m['sync/ckpt_uploads_ok']:.0f} checkpoint(s) uploaded to {self.dest}, "
            f"{m['sync/ckpt_upload_failures']:.0f} failed, {m['sync/ckpt_uploads_skipped']:.0f} skipped; "
            f"{final}; run logs {'uploaded' if self._logs_ok else 'not uploaded'}",
            flush=True,
        )

    def _stop_helper(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)  # the group this syncer created (start_new_session)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue


def _ignore_stop_signals() -> None:
    """The trainer's stop signals must not kill an upload (see the module docstring)."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def make_syncer(cfg: SyncCfg, run_name: str, is_main: bool) -> CheckpointSyncer | NullSyncer:
    """Call config.resolve.resolve_target first (on every rank)."""
    return CheckpointSyncer(cfg, run_name) if is_main and cfg.remote else NullSyncer()


# ---------------------------------------------------------------------------------- helper process
def upload(job: dict, retries: int, backoff_s: float) -> dict:
    """One job with retries and exponential backoff; returns the result line for the parent."""
    from rclone_python.utils import RcloneException, run_rclone_cmd

    name, src, dst = job["name"], job["src"], job["dst"]
    if job.get("logs"):
        commands = [(f'copy "{src}" "{dst}"', RCLONE_ARGS + LOGS_FILTER)]
    elif job.get("final"):  # src: the checkpoints directory; the kept ones, each marker after all files
        keep = [f"--filter '- /*/{COMPLETE}'", *(f"--filter '+ /{n}/**'" for n in job["final"]), "--filter '- **'"]
        commands = [(f'copy "{src}" "{dst}"', RCLONE_ARGS + keep)]
        commands += [(f'copyto "{src}/{n}/{COMPLETE}" "{dst}/{n}/{COMPLETE}"', RCLONE_ARGS) for n in job["final"]]
    else:  # the marker last, in a command of its own (see the module docstring)
        commands = [
            (f'copy "{src}" "{dst}"', [*RCLONE_ARGS, f"--exclude /{COMPLETE}"]),
            (f'copyto "{src}/{COMPLETE}" "{dst}/{COMPLETE}"', RCLONE_ARGS),
        ]
    for attempt in range(1, retries + 2):
        if not Path(src).is_dir():  # pruned by ckpt.keep_last before its turn came
            print(f"sync: {name} was deleted locally before it could be uploaded; skipped", file=sys.stderr, flush=True)
            return {"name": name, "ok": False, "skipped": True, "attempts": attempt}
        t0 = time.monotonic()
        try:
            # rclone-python's command runner rather than rclone.copy(): that one keeps only JSON log lines
            # and loses errors rclone prints before its log starts ("didn't find section in config file").
            for command, args in commands:  # raises on the first failure: the marker is not sent
                run_rclone_cmd(command, args=args)
            return {"name": name, "ok": True, "seconds": time.monotonic() - t0, "attempts": attempt}
        except (RcloneException, OSError) as e:
            error = " | ".join(str(getattr(e, "error_msg", "") or e).strip().splitlines()[-2:])[:500]
        if attempt <= retries:
            wait = backoff_s * 2 ** (attempt - 1)
            print(
                f"sync: upload of {name} failed (attempt {attempt}/{retries + 1}): {error}; retrying in {wait:g} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(wait)
    print(
        f"sync: giving up on {name} after {retries + 1} attempts: {error}; it stays at {src}",
        file=sys.stderr,
        flush=True,
    )
    return {"name": name, "ok": False, "attempts": retries + 1}


def _read_jobs(jobs: queue.Queue) -> None:
    for line in sys.stdin:
        jobs.put(line)
    jobs.put(None)  # the trainer closed stdin (or died): finish what is queued, then exit


def helper_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Upload helper of CheckpointSyncer: JSON jobs on stdin, results on stdout")
    ap.add_argument("--retries", type=int, required=True)
    ap.add_argument("--backoff-s", type=float, required=True)
    args = ap.parse_args(argv)
    _ignore_stop_signals()  # again: the helper may be started by hand (see the module docstring)
    import logging

    from rclone_python import rclone
    from rclone_python.logs import logger

    logger.setLevel(logging.ERROR)  # its per-line warnings repeat what upload() prints once
    installed = rclone.is_installed()
    if not installed:
        print(
            "sync: no rclone binary on PATH (Debian/Ubuntu: apt-get install rclone); nothing is uploaded",
            file=sys.stderr,
        )
    # Read stdin in a thread so that the pipe never fills up and blocks the trainer's submit(), however far
    # the uploads fall behind.
    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_read_jobs, args=(jobs,), daemon=True).start()
    while (line := jobs.get()) is not None:
        job = json.loads(line)
        result = upload(job, args.retries, args.backoff_s) if installed else {"name": job["name"], "ok": False}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(helper_main())
