"""A pool of long-lived bubblewrap sandboxes, each a template process that forks one fresh candidate per program.

Isolation (strict mode, the default): bwrap started as an unprivileged host uid (65534 when the trainer is
root: as root without a user namespace the sandbox would keep full capabilities and RLIMIT_NPROC would not
hold), with new user (uid 65534 inside, no nested user namespaces), pid, net, ipc and uts namespaces, a
read-only view of /usr only (plus the interpreter's prefix), a fresh /proc and /dev, a private size-limited
/tmp and /dev/shm (one budget between them), an empty environment, a new session (no TIOCSTI into the trainer's
terminal), --die-with-parent and a system-call filter (seccomp_filter.py). The template is the sandbox's pid 1
(--as-pid-1): every process inside is filtered, and the one that outlives each program is not dumpable (see
bwrap_argv). Each candidate gets rlimits (CPU, address space, processes, file size, open files, no core). A worker
is also put in a memory cgroup of its own where the machine delegates one (`delegated_cgroup`); elsewhere the
filter denies memfd_create, so that no memory escapes RLIMIT_AS but the bounded tmpfs. Where user namespaces or
libseccomp are unavailable the pool refuses to start (`SandboxUnavailable` says why and what to do), unless
mode='weak' is asked for: no namespaces and no filter, only the unprivileged uid and the rlimits; it warns on every
batch and the programs it ran are counted (`Pool.weak_runs`). `Pool.protections` reports what is in force.

The pool only runs programs and moves plain messages; its user decides verdicts (the code task's
rl_training/tasks/code/harness.py, the python tool's rl_training/tasks/python_tool.py).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

from rl_training.sandbox import seccomp_filter, worker

NOBODY = 65534
# A job mostly waits on round trips between two processes, so more workers than cores keeps the cores busy;
# on 2 busy cores (scripts/bench_sandbox.py) 4 per core gave 168 programs/s, 2 per core 118. More lets
# CPU-bound programs share a core enough to risk their wall-clock deadline (docs/code.md).
WORKERS_PER_CORE = 4
_WORKER_SRC = Path(worker.__file__).read_text()


def default_cores(ranks_per_node: int = 1, affinity: int | None = None, node_cores: int | None = None) -> int:
    """The cores one rank's pool is sized for: the node's cores divided among its ranks, and never more than the
    rank may run on. The affinity mask alone is not enough: ranks bound to one socket each see the whole socket
    (4 ranks on a 112-CPU socket of a DGX would start 4 x 448 sandboxes; issue 29, N7)."""
    affinity = affinity or len(os.sched_getaffinity(0))
    node_cores = node_cores or os.cpu_count() or affinity
    return max(1, min(affinity, node_cores // max(1, ranks_per_node)))


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start on this machine; the message says why and what to do."""


class SandboxBroken(RuntimeError):
    """A worker stopped answering its control protocol (killed, stopped or crashed); it is replaced."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 0  # RLIMIT_CPU per candidate; 0 = the program's wall deadline rounded up, + 1 s
    mem_bytes: int = 1 << 30  # RLIMIT_AS per candidate
    nproc: int = 8  # RLIMIT_NPROC: processes of the sandbox uid in the worker (the template counts)
    fsize_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file a candidate may write
    nofile: int = 64  # RLIMIT_NOFILE
    msg_bytes: int = 1 << 20  # largest message (a returned value, captured stdout) the trusted side reads

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class PoolSettings:
    workers: int = 0  # 0 = 4 per CPU core this rank may use (WORKERS_PER_CORE x default_cores)
    ranks_per_node: int = 1  # the ranks that share this node's cores (torchrun's LOCAL_WORLD_SIZE)
    mode: Literal["strict", "weak"] = "strict"
    limits: Limits = Limits()
    tmpfs_bytes: int = 64 << 20  # the private /tmp and /dev/shm of each worker together (a quarter is /dev/shm)
    python: str = ""  # interpreter run inside; "" = this one if the sandbox uid can read it, else /usr/bin/python3
    seccomp: bool = True  # strict mode's system-call filter; off only for the tests' controls and the benchmark
    seccomp_errno: int = errno.EPERM  # what the filter answers a refused call (tests mark the filter's refusals)
    fresh: bool = False  # True: every worker runs one job and is closed, a new sandbox per job (the python tool)

    @classmethod
    def from_cfg(cls, cfg, ranks_per_node: int = 1, fresh: bool = False) -> PoolSettings:
        """A run's sandbox.* (config's SandboxCfg: workers, mode, memory_mb, output_kb; read by name, so this leaf
        imports no config) as the settings of one rank's pool."""
        limits = Limits(mem_bytes=cfg.memory_mb << 20, msg_bytes=cfg.output_kb << 10)
        return cls(workers=cfg.workers, mode=cfg.mode, limits=limits, ranks_per_node=ranks_per_node, fresh=fresh)


@dataclass(frozen=True)
class Protections:
    """What this pool's sandboxes enforce (docs/code.md says what each stops); logged once when a task starts it."""

    mode: str
    namespaces: bool  # user, pid, net, ipc, uts namespaces and the read-only filesystem view (strict mode)
    uid: int  # the uid programs run as
    seccomp: bool  # the system-call filter (seccomp_filter.py)
    seccomp_allowed: int  # system calls the filter lets through (by name, or by argument)
    seccomp_refusal: str  # what every other one returns (an errno name: EPERM)
    seccomp_denied: tuple[str, ...]  # the denials tests/unit/sandbox/ try, those that exist on this architecture
    memory: str  # "cgroup" | "memfd-denied+shm-in-tmpfs" | "rlimits-only"
    memory_note: str  # the cgroup's bound, or why there is none
    tmp_bytes: int  # /tmp's tmpfs
    shm_bytes: int  # /dev/shm's tmpfs

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        named = ", ".join(self.seccomp_denied[:6])
        filt = (
            f"on ({self.seccomp_allowed} system calls allowed, the rest {self.seccomp_refusal}, among them "
            f"{named} ... {len(self.seccomp_denied)} named in docs/code.md)"
            if self.seccomp
            else "off"
        )
        return (
            f"mode {self.mode}, namespaces {'on' if self.namespaces else 'off'}, uid {self.uid}, seccomp {filt}, "
            f"memory {self.memory} ({self.memory_note}), tmpfs {self.tmp_bytes >> 20} MiB /tmp + "
            f"{self.shm_bytes >> 20} MiB /dev/shm"
        )


@dataclass(frozen=True)
class Confinement:
    """What each worker starts with beyond its bwrap arguments: the compiled filter (None: none) and the cgroup
    directory its own memory cgroup of `cgroup_bytes` is created under (None: not delegated)."""

    bpf: bytes | None = None
    cgroup: Path | None = None
    cgroup_bytes: int = 0


def tmpfs_split(total: int) -> tuple[int, int]:
    """(/tmp, /dev/shm) sizes: one budget for both, so a program holds at most `total` bytes in tmpfs memory."""
    return total - total // 4, total // 4


def _interpreter_candidates(setting: str) -> list[str]:
    if setting:
        return [setting]
    here = os.path.realpath(sys.executable)
    return [here] + ([p] if (p := shutil.which("python3", path="/usr/bin")) and os.path.realpath(p) != here else [])


def worker_argv(python: str, ctl_fd: int, mode: str, fresh: bool) -> list[str]:
    """The interpreter's command line: worker.py's template. A fresh pool's template serves one program, so it
    skips the modules a reused one preloads for all of its programs (about 13 ms of a 65 ms start, measured)."""
    return [python, "-I", "-S", "-B", "-c", _WORKER_SRC, str(ctl_fd), mode, "lean" if fresh else "preload"]


def bwrap_argv(
    python: str, tmpfs_bytes: int, ctl_fd: int, seccomp_fd: int | None = None, fresh: bool = False
) -> list[str]:
    """The bwrap command line of one strict worker (see the module docstring for what each part stops)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap is not installed: `apt-get install -y bubblewrap` (Debian/Ubuntu), or set "
            "sandbox.mode=weak to run programs with rlimits only (no namespaces; see docs/code.md)"
        )
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    argv = [bwrap, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox"]
    # The template is the pid namespace's init, not a bwrap reaper beside it: bwrap's pid 1 is dumpable (a program
    # of the same uid could write /proc/1/mem and run code there that outlives the reap, and so reaches the next
    # program of the worker), the template is not. As init it reaps orphans, kill(-1) from it reaches every other
    # process inside, and a program's signals to it are ignored (it has no handler for them).
    argv += ["--as-pid-1"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib64", "sbin"):  # merged-/usr symlinks, or read-only binds where they are dirs
        p = Path("/") / d
        if p.is_symlink():
            argv += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            argv += ["--ro-bind", str(p), str(p)]
    if not prefix.startswith("/usr/") and prefix != "/usr":
        argv += ["--ro-bind", prefix, prefix]
    tmp, shm = tmpfs_split(tmpfs_bytes)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    # bwrap's /dev is a tmpfs without a size limit: read-only, with a size-limited /dev/shm of its own
    argv += ["--size", str(shm), "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--remount-ro", "/"]
    argv += ["--clearenv", "--new-session", "--die-with-parent"]
    if seccomp_fd is not None:  # bwrap reads the program from the fd and loads it just before the exec
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--", *worker_argv(python, ctl_fd, "strict", fresh)]


class Worker:
    """One sandbox: a bwrap process whose template forks candidates; driven over a SOCK_SEQPACKET socket.

    Starting is two steps: the constructor starts bwrap (fast; the Pool does it on its spawner thread, see there),
    `wait_ready` waits for the template's answer (tens of ms: bwrap, the interpreter, its imports); with
    wait=False the caller does the second step, on any thread, so that several sandboxes start at once."""

    def __init__(
        self, settings: PoolSettings, python: str, confinement: Confinement = Confinement(), wait: bool = True
    ):
        self.settings, self.python = settings, python
        self.cgroup: Path | None = None
        self._lock = threading.Lock()  # kill() from Pool.close against close() from the thread that owns it
        self._closed = False
        ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        strict = settings.mode == "strict"
        fd = theirs.fileno()
        bpf = seccomp_filter.bpf_fd(confinement.bpf) if strict and confinement.bpf is not None else None
        argv = (
            bwrap_argv(python, settings.tmpfs_bytes, fd, bpf, settings.fresh)
            if strict
            else worker_argv(python, fd, "weak", settings.fresh)
        )
        drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
        self._err = tempfile.TemporaryFile()
        try:
            self.proc = self._start(argv, [fd] if bpf is None else [fd, bpf], drop, confinement)
        except OSError as e:
            ctl.close()
            theirs.close()
            if self.cgroup is not None:
                remove_worker_cgroup(self.cgroup)
            raise SandboxUnavailable(f"cannot start the sandbox ({argv[0]}): {e}") from None
        finally:
            if bpf is not None:
                os.close(bpf)
        theirs.close()
        self.ctl = ctl
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait for the template's first answer; a sandbox that does not give it is closed and SandboxUnavailable
        says why (bwrap's own error output)."""
        try:
            self.request({"op": "ping"}, timeout=timeout)
        except SandboxBroken:
            self._err.seek(0)
            err = self._err.read().decode(errors="replace").strip()[-2000:]
            self.close()
            raise SandboxUnavailable(_explain(err, self.settings.mode == "strict")) from None

    def _start(self, argv: list[str], fds: list[int], drop: dict, confinement: Confinement) -> subprocess.Popen:
        gate = None
        if confinement.cgroup is not None:
            # The child waits on its stdin until it is in its cgroup (moved from here: the sandbox uid may not),
            # so bwrap and everything it forks start inside; if this side fails first, it reads EOF and exits.
            self.cgroup = make_worker_cgroup(confinement.cgroup, confinement.cgroup_bytes)
            gate = os.pipe()
            argv = ["/bin/sh", "-c", 'read -r _ && exec "$@" </dev/null', "sh", *argv]
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=fds,
                stdin=subprocess.DEVNULL if gate is None else gate[0],
                stdout=subprocess.DEVNULL,
                stderr=self._err,
                env={},
                cwd="/",
                start_new_session=True,
                **drop,
            )
        except OSError:
            if gate is not None:
                os.close(gate[1])
            raise
        finally:
            if gate is not None:
                os.close(gate[0])
        if gate is not None:
            try:
                (self.cgroup / "cgroup.procs").write_text(str(proc.pid))
            except OSError as e:
                os.close(gate[1])  # EOF: the child exits without starting bwrap
                proc.wait()
                raise OSError(e.errno, f"cannot enter the memory cgroup {self.cgroup}: {e.strerror}") from None
            os.write(gate[1], b"\n")
            os.close(gate[1])
        return proc

    def send(self, msg: dict, fds: tuple[int, ...] = ()) -> None:
        try:
            self.ctl.settimeout(REAP_S)
            socket.send_fds(self.ctl, [json.dumps(msg).encode()], list(fds))
        except OSError as e:  # socket.timeout is an OSError
            raise SandboxBroken(f"worker did not take {msg['op']!r}: {type(e).__name__}") from None

    def request(self, msg: dict, timeout: float) -> dict:
        self.send(msg)
        try:
            self.ctl.settimeout(timeout)
            data = self.ctl.recv(1 << 16)
        except OSError as e:
            raise SandboxBroken(f"worker did not answer {msg['op']!r}: {type(e).__name__}") from None
        if not data:
            raise SandboxBroken(f"worker closed during {msg['op']!r}")
        return json.loads(data)

    def kill(self) -> None:
        """SIGKILL to the sandbox, from another thread than the one that owns it (that one still calls close):
        a start waiting for the template's answer then reads end-of-file. A no-op once closed, so that a pid
        reaped and reused is never signalled."""
        with self._lock:
            if not self._closed:
                try:
                    os.killpg(self.proc.pid, 9)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        """Kill the whole sandbox: SIGKILL to bwrap's session (the bwrap outside the namespace; the template is in a
        session of its own, --new-session) fires the template's --die-with-parent SIGKILL, and the end of the pid
        namespace's init takes every process inside with it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.ctl.close()
        self._err.close()
        if self.cgroup is not None:
            remove_worker_cgroup(self.cgroup)


# ------------------------------------------------------------------------------------------- memory cgroups
CGROUP_HEADROOM = 64 << 20  # a worker's template interpreter and bwrap, beside one program's memory and the tmpfs
_worker_ids = itertools.count()


def delegated_cgroup(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> tuple[Path | None, str]:
    """The cgroup v2 directory of this process, where workers' memory cgroups can be made, or None and why not:
    it must be writable by us, with the memory controller enabled for its children (a delegated subtree)."""
    try:
        own = [line[3:] for line in Path(proc_cgroup).read_text().splitlines() if line.startswith("0::")]
        mounts = [line.partition(" - ") for line in Path(mountinfo).read_text().splitlines()]
    except OSError as e:
        return None, f"cannot read {e.filename}: {e.strerror}"
    v2 = [pre.split()[3:5] for pre, _, post in mounts if post.split()[:1] == ["cgroup2"]]
    if not own:
        return None, f"no cgroup v2 entry in {proc_cgroup} (cgroup v1 only)"
    if not v2:
        return None, f"no cgroup2 file system in {mountinfo}"
    (root, mount_point), rel = v2[0], own[0]
    if root != "/" and (rel == root or rel.startswith(root + "/")):  # the mount shows a subtree of the hierarchy
        rel = rel[len(root) :]
    d = Path(mount_point) / rel.lstrip("/")
    try:
        controllers = (d / "cgroup.controllers").read_text().split()
        enabled = (d / "cgroup.subtree_control").read_text().split()
    except OSError as e:
        return None, f"cannot read {e.filename}: {e.strerror}"
    if "memory" not in controllers:
        return None, f"cgroups are not delegated: no memory controller in {d} ({' '.join(controllers) or 'none'})"
    if "memory" not in enabled:
        return None, f"cgroups are not delegated: memory is not in {d}/cgroup.subtree_control"
    if not os.access(d, os.W_OK):
        return None, f"cgroups are not delegated: {d} is not writable by uid {os.geteuid()}"
    return d, f"delegated: {d}"


def make_worker_cgroup(parent: Path, limit: int) -> Path:
    """A memory cgroup for one worker under `parent`: `limit` bytes of memory (shared memory and memfd included,
    which RLIMIT_AS does not count), no swap."""
    d = parent / f"rl-sandbox-{os.getpid()}-{next(_worker_ids)}"
    d.mkdir()
    (d / "memory.max").write_text(str(limit))
    if (d / "memory.swap.max").exists():  # absent without swap accounting
        (d / "memory.swap.max").write_text("0")
    return d


def remove_worker_cgroup(d: Path) -> None:
    """Kill what is left in a worker's cgroup and remove it; the kernel lets it go once its last process is
    reaped, which for the processes of a dying pid namespace takes a moment."""
    if (d / "cgroup.kill").exists():
        (d / "cgroup.kill").write_text("1")
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.01)


def confine(settings: PoolSettings) -> tuple[Confinement, Protections]:
    """What a pool's workers start with, and the report of it. Strict mode refuses to start without the filter
    (SandboxUnavailable says what to install) unless settings.seccomp is off."""
    strict = settings.mode == "strict"
    cgroup, why = delegated_cgroup()
    budget = settings.limits.mem_bytes + settings.tmpfs_bytes + CGROUP_HEADROOM
    bpf, allowed, denied = None, 0, ()
    if strict and settings.seccomp:
        try:
            bpf, allowed = seccomp_filter.compile_bpf(cgroup is not None, settings.seccomp_errno)
        except seccomp_filter.FilterUnavailable as e:
            raise SandboxUnavailable(str(e)) from None
        skip = seccomp_filter.MEMFD if cgroup is not None else ()
        denied = tuple(n for n in seccomp_filter.native_numbers(seccomp_filter.DENIED) if n not in skip)
    if cgroup is not None:
        memory, note = "cgroup", f"memory.max {budget >> 20} MiB per worker, no swap, under {cgroup}"
    elif bpf is not None:
        memory, note = "memfd-denied+shm-in-tmpfs", f"no memory cgroup: {why}"
    else:
        memory, note = "rlimits-only", f"no memory cgroup: {why}; memfd_create and SysV shm not denied"
    tmp, shm = tmpfs_split(settings.tmpfs_bytes) if strict else (0, 0)
    uid = NOBODY if strict or os.geteuid() == 0 else os.geteuid()
    refusal = errno.errorcode.get(settings.seccomp_errno, str(settings.seccomp_errno)) if bpf is not None else ""
    report = Protections(settings.mode, strict, uid, bpf is not None, allowed, refusal, denied, memory, note, tmp, shm)
    return Confinement(bpf, cgroup, budget), report


def _explain(err: str, strict: bool) -> str:
    if not strict:
        return f"the weak-mode worker did not start: {err or 'no error output'}"
    return (
        f"bubblewrap cannot create the sandbox here ({err or 'no error output'}). It needs unprivileged user "
        "namespaces: check `sysctl user.max_user_namespaces` (> 0), `kernel.unprivileged_userns_clone=1` "
        "(Debian), `kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04+), or a container started "
        "with a seccomp profile that allows clone(CLONE_NEWUSER). Run `python -m rl_training.runners.sandbox_check` to "
        "test a node. To run anyway without namespaces, set sandbox.mode=weak (warned and counted every step)."
    )


REAP_S = 5.0  # a worker that takes longer to start a candidate or to kill and reap a job's processes is broken
T = TypeVar("T")


class JobTimeout(Exception):
    """The program's wall-clock deadline passed."""


class Job:
    """The trusted end of one candidate's socket: request/answer with the job's deadline and message cap.
    Raises JobTimeout past the deadline, worker.ProtocolError for an oversized, malformed or cut message."""

    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int):
        self.sock, self.deadline, self.max_bytes = sock, deadline, max_bytes

    def ask(self, msg: dict) -> dict:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JobTimeout
        self.sock.settimeout(left)
        try:
            worker.send_msg(self.sock, msg)
            reply = worker.recv_msg(self.sock, self.max_bytes)
        except TimeoutError:
            raise JobTimeout from None
        except OSError as e:  # the candidate died or closed its end
            raise worker.ProtocolError(f"candidate gone: {type(e).__name__}") from None
        if not isinstance(reply, dict):
            raise worker.ProtocolError("reply is not an object")
        return reply


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

    def __init__(self, settings: PoolSettings = PoolSettings()):
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
