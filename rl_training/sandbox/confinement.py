"""What a sandbox is confined by, and how one is started: the settings (PoolSettings, Limits), the bwrap and interpreter
command lines, the memory cgroups, and `confine`, which compiles the filter and reports what is in force.

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
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rl_training.sandbox import seccomp_filter, worker

NOBODY = 65534
_WORKER_SRC = Path(worker.__file__).read_text()


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start on this machine; the message says why and what to do."""


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
        """A run's sandbox.* (config's SandboxCfg: workers, mode, memory_mb, output_kb; read by name, so the
        confined tier imports no config) as the settings of one rank's pool."""
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


def start_failure(err: str, strict: bool) -> str:
    """Why a sandbox did not give its first answer (`err`: its error output), and what to do."""
    if not strict:
        return f"the weak-mode worker did not start: {err or 'no error output'}"
    return (
        f"bubblewrap cannot create the sandbox here ({err or 'no error output'}). It needs unprivileged user "
        "namespaces: check `sysctl user.max_user_namespaces` (> 0), `kernel.unprivileged_userns_clone=1` "
        "(Debian), `kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04+), or a container started "
        "with a seccomp profile that allows clone(CLONE_NEWUSER). Run `python -m rl_training.runners.sandbox_check` to "
        "test a node. To run anyway without namespaces, set sandbox.mode=weak (warned and counted every step)."
    )
