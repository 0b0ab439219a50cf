"""A pool of long-lived bubblewrap sandboxes, each a template process that forks one fresh candidate per program:
idle workers handed out one job at a time, sized for the cores of a rank (default_cores), started side by side
in the background. What each sandbox enforces: confinement.py; the handle on one: handle.py.

The pool only runs programs and moves plain messages; its user decides verdicts (the code task's
rl_training/tasks/code/harness.py, the python tool's rl_training/tasks/python_tool.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from rl_training.sandbox.confinement import Limits, PoolSettings, SandboxUnavailable, confine
from rl_training.sandbox.handle import REAP_S, Job, SandboxBroken, Worker

# A job mostly waits on round trips between two processes, so more workers than cores keeps the cores busy;
# on 2 busy cores (scripts/bench_sandbox.py) 4 per core gave 168 programs/s, 2 per core 118. More lets
# CPU-bound programs share a core enough to risk their wall-clock deadline (docs/code.md).
WORKERS_PER_CORE = 4


def default_cores(ranks_per_node: int = 1, affinity: int | None = None, node_cores: int | None = None) -> int:
    """The cores one rank's pool is sized for: the node's cores divided among its ranks, and never more than the
    rank may run on. The affinity mask alone is not enough: ranks bound to one socket each see the whole socket
    (4 ranks on a 112-CPU socket of a DGX would start 4 x 448 sandboxes; issue 29, N7)."""
    affinity = affinity or len(os.sched_getaffinity(0))
    node_cores = node_cores or os.cpu_count() or affinity
    return max(1, min(affinity, node_cores // max(1, ranks_per_node)))


def _interpreter_candidates(setting: str) -> list[str]:
    if setting:
        return [setting]
    here = os.path.realpath(sys.executable)
    return [here] + ([p] if (p := shutil.which("python3", path="/usr/bin")) and os.path.realpath(p) != here else [])


T = TypeVar("T")


@dataclass(frozen=True)
class Ran(Generic[T]):
    result: T | None  # what drive() returned (None when the worker broke)
    clean: bool  # the worker confirmed every process of the job was killed and reaped
    status: int | None  # wait status of the candidate if it had ended on its own (classification hint only)


class Pool:
    """Idle workers handed out one job at a time; a worker that misbehaves is replaced by a fresh one.

    With settings.fresh every worker serves one job and is then closed: each job starts on a sandbox made for it
    (its own /tmp, /dev/shm, pid, ipc, uts and net namespaces), where a reused worker only empties /tmp and
    /dev/shm between jobs and keeps the rest (docs/code.md lists what). A replacement is started when a worker is
    handed out, so `size` sandboxes are ready or starting while up to `size` run jobs."""

    def __init__(self, settings: PoolSettings = PoolSettings()):  # noqa: B008 -- frozen, so one default is safe
        self.settings = settings
        n = settings.workers or WORKERS_PER_CORE * default_cores(settings.ranks_per_node)
        self.confinement, self.protections = confine(settings)
        self.python = self._pick_python()
        self._idle: list[Worker] = []
        self._cv = threading.Condition()
        self._starting: set[Worker] = set()  # bwrap started, its template not yet answering (Pool.close kills them)
        self._pending = 0  # starts asked for and not yet ended (idle, failed or closed)
        self._busy = 0
        self._start_error: SandboxUnavailable | None = None
        self._closed = False
        self.weak_runs = 0
        self.restarts = 0
        self.size = n
        # bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that started it ends:
        # every worker is started from this one long-lived thread, never from a scoring thread. Only the fork and
        # exec happen there; the wait for the template's answer (the slow part) runs on the starter threads, so
        # that sandboxes start side by side.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="sandbox-spawn")
        self._starter = ThreadPoolExecutor(min(n, 64), thread_name_prefix="sandbox-start")
        try:
            with self._cv:
                self._refill()
                self._cv.wait_for(lambda: not self._pending)
                if self._start_error is not None:
                    raise self._start_error
        except BaseException:
            self.close()
            raise

    def _pick_python(self) -> str:
        errors = []
        for py in _interpreter_candidates(self.settings.python):
            try:
                Worker(self.settings, py, self.confinement).close()
                return py
            except SandboxUnavailable as e:
                errors.append(f"{py}: {e}")
        raise SandboxUnavailable("; ".join(errors))

    def _refill(self) -> None:
        """Start workers (in the background) until `size` are idle or starting; called holding self._cv."""
        for _ in range(self.size - len(self._idle) - self._pending):
            self._pending += 1
            self._starter.submit(self._start_one)

    def _start_one(self) -> None:
        """One background start: bwrap on the spawner thread, then the wait for its template here."""
        w, error = None, None
        try:
            if self._closed:
                return
            w = self._spawner.submit(Worker, self.settings, self.python, self.confinement, False).result()
            with self._cv:
                self._starting.add(w)
                if self._closed:
                    w.kill()
            w.wait_ready()
        except SandboxUnavailable as e:
            error = e
        except Exception as e:  # noqa: BLE001 -- raised to the next acquire, not lost in this thread's future
            error = SandboxUnavailable(f"cannot start a sandbox: {type(e).__name__}: {e}")
        finally:
            with self._cv:
                self._pending -= 1
                self._starting.discard(w)
                if error is None and w is not None and not self._closed:
                    self._idle.append(w)
                    w = None
                elif error is not None and not self._closed:
                    self._start_error = error
                self._cv.notify_all()
            if w is not None:
                w.close()

    def _spawn(self) -> Worker:
        w = self._spawner.submit(Worker, self.settings, self.python, self.confinement, False).result()
        w.wait_ready()
        return w

    def acquire(self) -> Worker:
        """An idle worker; in fresh mode its replacement starts now, so the next job finds one ready. A start that
        failed (SandboxUnavailable) is raised here once nothing else is idle or starting."""
        with self._cv:
            while True:
                if self._closed:
                    raise RuntimeError("the sandbox pool is closed")
                if self._idle and self._busy < self.size:
                    break
                if self._start_error is not None and not self._pending:
                    error, self._start_error = self._start_error, None
                    raise error
                if self.settings.fresh and self._start_error is None:
                    self._refill()
                self._cv.wait()
            w = self._idle.pop()
            self._busy += 1
            if self.settings.fresh:
                self._refill()
            return w

    def release(self, w: Worker, broken: bool) -> None:
        """A worker back from a job: idle again, or closed (fresh mode, broken, or the pool closed meanwhile); a
        broken one of a reused pool is replaced here, by the caller's thread, as it always was."""
        if broken:
            self.restarts += 1
        keep = not (broken or self.settings.fresh or self._closed)
        if not keep:
            w.close()
        try:
            if broken and not self.settings.fresh and not self._closed:
                w, keep = self._spawn(), True
        finally:
            with self._cv:
                self._busy -= 1
                if keep and not self._closed:
                    self._idle.append(w)
                    keep = False
                self._cv.notify_all()
            if keep:  # the pool closed while this worker ran a job or started
                w.close()

    def run(self, drive: Callable[[Job], T], timeout_s: float, limits: Limits | None = None) -> Ran[T]:
        """drive(job) against a fresh candidate in an idle worker, then every process of the job killed and
        reaped. `clean` is False when the worker failed to confirm that (it is then replaced, which kills its
        whole pid namespace): a caller must not report a pass for such a run."""
        limits = limits or self.settings.limits
        if not limits.cpu_s:  # CPU time can never outlast the wall deadline; the limit backs it up
            limits = dataclasses.replace(limits, cpu_s=math.ceil(timeout_s) + 1)
        w = self.acquire()
        ours, theirs = socket.socketpair()
        broken, result, status = False, None, None
        try:
            try:
                w.send({"op": "run", "limits": limits.as_dict()}, fds=(theirs.fileno(),))
            finally:
                theirs.close()
            result = drive(Job(ours, time.monotonic() + timeout_s, limits.msg_bytes))
        except SandboxBroken:
            broken = True
        finally:
            ours.close()
            if not broken:
                try:  # a fresh pool's sandbox is closed next: its /tmp and /dev/shm go with it
                    reap = {"op": "reap", "empty": not self.settings.fresh}
                    status = w.request(reap, timeout=REAP_S).get("status")
                except SandboxBroken:
                    broken = True
            if self.settings.mode == "weak":
                self.weak_runs += 1
            self.release(w, broken)
        return Ran(result, not broken, status if isinstance(status, int) else None)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every worker: the idle ones, those starting (their starts then end), and those running a job as
        they come back."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            for w in self._starting:
                w.kill()
            self._cv.notify_all()
        for w in idle:
            w.close()
        self._starter.shutdown(wait=True, cancel_futures=True)
        self._spawner.shutdown()
