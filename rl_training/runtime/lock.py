"""One writer per run directory: an exclusive `flock` on a file inside it, held for the writer's lifetime.

Rank 0 takes the lock before it writes anything; a second run on the same directory fails at once with one
line naming the holder (host, pid, start time, as the holder wrote them into the lock file). The kernel
drops the lock with the process, so a crashed or killed run never blocks the next one.

`flock` rather than `fcntl(F_SETLK)`: POSIX record locks belong to the process and vanish when *any* file
descriptor of the file is closed (reading the holder line would release our own lock), and a process can
re-take its own POSIX lock (two runs in one Python process, as the tests do, would not exclude each other).
On NFS, Linux implements `flock` with NFS byte-range locks (lockd / NFSv4), so it excludes writers on other
hosts too. What cannot be detected: a mount that keeps locks local to each host (NFS `nolock`/`local_lock`,
Lustre `localflock`); `mount_warning` names those from /proc/mounts. docs/reliability.md has the details.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from rl_training.base import dist
from rl_training.base.errors import UserError
from rl_training.config.schema import derive

LOCK_FILE = "LOCK"
# flock's answers on file systems that cannot lock (NFS without lockd, Lustre mounted without -o flock)
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunLockError(UserError, RuntimeError):
    """Another process holds the run directory, or its file system cannot lock."""


def holder_line() -> str:
    """What the lock file says about its holder: host, pid and start time (UTC)."""
    return f"host={socket.gethostname()} pid={os.getpid()} started={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"


def mount_warning(path: Path) -> str | None:
    """A note when `path` lies on a mount whose locks are known to be local to one host, else None."""
    try:
        mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = str(Path(path).resolve())
    best = max(
        (m for m in mounts if len(m) >= 4 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))),
        key=lambda m: len(m[1]),
        default=None,
    )
    if best is None:
        return None
    fstype, opts = best[2], set(best[3].split(","))
    local = opts & {"nolock", "local_lock=all", "local_lock=flock"}
    if fstype.startswith("nfs") and local:
        return f"{best[1]} is {fstype} mounted with {','.join(sorted(local))}"
    if fstype == "lustre" and "localflock" in opts:
        return f"{best[1]} is Lustre mounted with localflock"
    return None


class RunLock:
    """Context manager holding `directory/LOCK`. enabled=False takes no lock and prints a warning instead."""

    def __init__(self, directory: Path, what: str, enabled: bool = True):
        self.path = Path(directory) / LOCK_FILE
        self.what, self.enabled = what, enabled
        self.fd: int | None = None
        self.made: list[Path] = []  # what acquire() created (the directory, the file): a refused run removes them
        self.found: set[str] = set()  # what the directory held before: a run that wrote nothing left just that

    def acquire(self) -> None:
        if not self.enabled:
            print(
                f"warning: run.lock=false: {self.path.parent} is not locked; a second {self.what} writing there at "
                "the same time would corrupt it (docs/reliability.md)",
                flush=True,
            )
            return
        self.made = [p for p in (*reversed(self.path.parent.parents), self.path.parent, self.path) if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.found = set(os.listdir(self.path.parent)) - {LOCK_FILE}
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            self.remove_if_unused()  # a lock that cannot be taken here leaves nothing behind either
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                held = self.path.read_text(errors="replace").strip() or "a process that has not written its name yet"
                raise RunLockError(f"{self.path.parent} is in use by another {self.what}: {held}") from None
            if e.errno in UNSUPPORTED:
                raise RunLockError(
                    f"{self.path}: this file system cannot lock ({errno.errorcode.get(e.errno, e.errno)}: NFS without "
                    "lockd, or Lustre without -o flock); use a local or lock-capable directory, or set run.lock=false "
                    "and make sure no two runs share it (docs/reliability.md)"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, (holder_line() + "\n").encode())
        self.fd = fd
        note = mount_warning(self.path.parent)
        if note:
            print(f"warning: {note}: its locks do not exclude writers on other hosts (docs/reliability.md)", flush=True)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock; the file stays (its content is stale)
            self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        held = self.fd is not None
        self.release()
        if held and exc_type is not None:
            self.remove_if_unused()

    def remove_if_unused(self) -> None:
        """After a run that failed before writing anything (a refused config, a bad task): the lock file and the
        directories acquire() made, so a refused run leaves nothing; no one else's file is touched, and a run that
        wrote anything (a config, a checkpoint) keeps its directory as it is."""
        for p in reversed(self.made):
            try:
                if p == self.path:
                    if set(os.listdir(p.parent)) - {LOCK_FILE} != self.found:
                        return
                    p.unlink()
                else:
                    p.rmdir()  # only when empty: OSError otherwise
            except OSError:
                return
        self.made = []


def locked(body: Callable, what: str, before: Callable[[], None] | None = None) -> Callable:
    """A runner body (cfg, info) -> status that holds its run directory's lock while it runs. `before` runs
    first, outside the lock: a check that refuses the run must not leave a run directory behind."""

    def run(cfg, info):
        if before is not None:
            before()
        with RankZeroLock(derive(cfg, info.world_size).run_dir, what, cfg.run.lock):
            return body(cfg, info)

    return run


class RankZeroLock(RunLock):
    """Rank 0 takes the lock; every rank learns the outcome (one broadcast), so all ranks fail together with
    the same one-line error instead of the others waiting in a collective for a rank that left."""

    def acquire(self) -> None:
        error = None
        if int(os.environ.get("RANK", 0)) == 0:
            try:
                super().acquire()
            except RunLockError as e:
                error = str(e)
        error = dist.broadcast_object(error)
        if error:
            raise RunLockError(error)
