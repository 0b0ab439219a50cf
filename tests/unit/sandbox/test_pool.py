"""The sandbox pool (rl_training/sandbox/): the codec and the framing, a sandbox per job, refusal without namespaces or
libseccomp, the pool's size, the system-call filter, the memory bound and the protections report. Programs are
judged with the code task's harness. Hostile programs: test_adversarial.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rl_training.sandbox import seccomp_filter as sf
from rl_training.sandbox import worker
from rl_training.tasks.code.harness import Program, judge

ADD = Program("def add(a, b):\n    return a + b\n", "call", tests=("assert add(1, 2) == 3", "assert add(-1, 1) == 0"))


def test_codec_roundtrip_keeps_types_and_refuses_objects():
    v = [1, 2.5, "s", None, True, (1, (2,)), {3, 4}, frozenset({5}), {(1, 2): [b"\xff"]}, 1j, float("inf")]
    got = worker.decode(json.loads(json.dumps(worker.encode(v))))
    assert got == v and type(got[5]) is tuple and type(got[6]) is set and type(got[8]) is dict
    assert math.isnan(worker.decode(worker.encode(float("nan"))))

    class Always:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError):
        worker.encode(Always())
    for forged in ({"$t": [1], "$s": [2]}, {"__class__": "x"}, {"$d": [[[1], 2]]}, {"$c": ["a", 1]}):
        with pytest.raises((ValueError, TypeError)):
            worker.decode(forged)


def test_the_shared_framing_refuses_a_big_frame_unread_and_ends_a_read_at_its_deadline():
    """worker.py's frames carry both tiers' messages (the pool's jobs, the tools' process): a frame over the cap is
    refused before its body is read, and a read with a deadline ends at it however slowly the bytes trickle in
    (each wait is only what is left of the deadline, not a fresh timeout per read)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        worker.send_frame(theirs, b"x" * 2000)
        with pytest.raises(worker.FrameTooBig, match="^message of 2000 bytes over the 1000-byte cap$"):
            worker.recv_frame(ours, 1000)
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def trickle():
        theirs.sendall(worker._HDR.pack(100))
        while not stop.wait(0.05):
            theirs.sendall(b"x")

    t = threading.Thread(target=trickle)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            worker.recv_frame(ours, 1000, deadline=t0 + 0.3)
        # 0.3 s when the deadline holds; a fresh 0.3 s per read would wait until the 100 bytes came (5 s): halfway
        assert time.monotonic() - t0 < 2.65
    finally:
        stop.set()
        t.join()
        ours.close()
        theirs.close()


# ---------------------------------------------------------------- a sandbox per job (the python tool's pool)
# The first job's program leaves what a reused worker's cleanup cannot remove: a directory it made unreadable.
PLANT = Program(
    "import os\n"
    "def f():\n"
    "    os.mkdir('/tmp/locked')\n"
    "    open('/tmp/locked/secret', 'w').write('42')\n"
    "    os.chmod('/tmp/locked', 0)\n"
    "    open('/dev/shm/marker', 'w').write('42')\n"
    "    return sorted(os.listdir('/tmp') + os.listdir('/dev/shm')), os.getpid()\n",
    "call",
    tests=("assert f() == (['locked', 'marker'], 2)",),  # the template is pid 1 (bwrap --as-pid-1), a job 2
)
LOOK = Program("import os\ndef f():\n    return os.listdir('/tmp') + os.listdir('/dev/shm'), os.getpid()\n",
               "call", tests=("assert f() == ([], 2)",))  # fmt: skip


def bwrap_pids(pool) -> list[int]:
    """The host pid of the bwrap each later job of `pool` runs in, recorded as the jobs take their workers."""
    seen, take = [], pool.acquire

    def acquire():
        w = take()
        seen.append(w.proc.pid)
        return w

    pool.acquire = acquire
    return seen


def test_a_fresh_pool_gives_every_job_a_sandbox_of_its_own():
    """PoolSettings.fresh: no job sees a file, a directory or the pid counter of an earlier one, and no sandbox
    serves two jobs. The reused pool (the code tasks') still serves the jobs of a 1-worker pool from one sandbox."""
    from rl_training.sandbox.confinement import PoolSettings
    from rl_training.sandbox.pool import Pool

    with Pool(PoolSettings(workers=1, fresh=True)) as fresh:
        seen = bwrap_pids(fresh)
        got = [judge(fresh, p, 5.0) for p in (PLANT, LOOK, PLANT, LOOK)]
        assert [(v.passed, v.failure) for v in got] == [(True, None)] * 4
        assert len(seen) == 4 and len(set(seen)) == 4 and fresh.restarts == 0
    with Pool(PoolSettings(workers=1)) as reused:
        seen = bwrap_pids(reused)
        assert judge(reused, ADD, 5.0).passed and judge(reused, ADD, 5.0).passed
        assert len(seen) == 2 and len(set(seen)) == 1


def test_fresh_sandboxes_start_side_by_side_and_close_kills_those_starting():
    """Handing out a worker starts its replacement in the background; two start at once (bwrap is forked on the
    spawner thread, the wait for the template is not), and Pool.close kills them mid-start, at once, as well as
    the ones whose jobs end after it. The replacements here run an interpreter that never answers, so a close that
    waited for them would take the 20 s a start is given."""
    from rl_training.sandbox.confinement import PoolSettings
    from rl_training.sandbox.pool import Pool

    before = set(worker.descendants(os.getpid()))
    # readable by the sandbox uid (tmp_path is not), and outside /tmp, which the sandbox mounts over
    bindir = Path(tempfile.mkdtemp(prefix="mute-python-", dir="/var/tmp"))
    (bindir / "bin").mkdir()
    mute = bindir / "bin" / "python"
    mute.write_text("#!/bin/sh\nexec sleep 60\n")
    for f in (bindir, bindir / "bin", mute):
        f.chmod(0o755)
    pool = Pool(PoolSettings(workers=2, fresh=True))
    try:
        pool.python = str(mute)  # the pool's own two started normally; their replacements do not
        busy = [pool.acquire(), pool.acquire()]
        deadline = time.monotonic() + 10.0
        while len(pool._starting) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(pool._starting) == 2  # both bwraps forked, both waiting for their templates
        t = time.monotonic()
        pool.close()
        assert time.monotonic() - t < 5.0
        with pytest.raises(RuntimeError, match="closed"):
            pool.acquire()
        for w in busy:
            pool.release(w, False)
        assert set(worker.descendants(os.getpid())) <= before  # every bwrap of the pool is gone (and reaped)
    finally:
        pool.close()
        shutil.rmtree(bindir)


def test_refuses_without_user_namespaces(monkeypatch):
    from rl_training.sandbox.confinement import PoolSettings, SandboxUnavailable
    from rl_training.sandbox.pool import Pool

    # A bwrap that fails as it does where user namespaces are off, in a directory the sandbox uid can read
    # (pytest's tmp_path is private to root).
    bindir = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    bindir.chmod(0o755)
    fake = bindir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    with pytest.raises(SandboxUnavailable, match="No permissions.*user.max_user_namespaces.*sandbox.mode=weak"):
        Pool(PoolSettings(workers=1))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        Pool(PoolSettings(workers=1))
    shutil.rmtree(bindir)


def test_pool_size_is_the_ranks_share_of_the_node():
    """Issue 29 N7: 4 ranks bound to one 112-CPU socket of a 224-CPU node each see 112 CPUs; sized by the mask each
    would start 4 x 112 = 448 sandboxes (1,792 on the socket). The node's cores / its ranks: 4 x 56 each."""
    from rl_training.sandbox.pool import WORKERS_PER_CORE, default_cores

    assert default_cores(ranks_per_node=4, affinity=112, node_cores=224) == 56
    assert default_cores(ranks_per_node=1, affinity=112, node_cores=224) == 112  # never more than the mask
    assert default_cores(ranks_per_node=8, affinity=2, node_cores=2) == 1  # at least one core
    assert WORKERS_PER_CORE * default_cores(4, 112, 224) * 4 == 896  # 4 per CPU over the node's 224


# ------------------------------------------------------------------ the filter, the memory bound, the report
# Issue 30's list: what the filter must refuse at least (Docker's default profile refuses them, or more).
MUST_DENY = """
io_uring_setup io_uring_enter io_uring_register keyctl add_key request_key bpf userfaultfd perf_event_open ptrace
process_vm_readv process_vm_writev mount umount2 pivot_root move_mount open_tree fsopen fsmount fsconfig fspick
unshare setns init_module finit_module delete_module kexec_load kexec_file_load reboot swapon swapoff acct quotactl
lookup_dcookie syslog settimeofday clock_settime adjtimex iopl ioperm name_to_handle_at open_by_handle_at
memfd_create shmget shmat
""".split()


def test_filter_lists_name_real_system_calls_and_deny_the_issues_list():
    import pyseccomp

    arches = (pyseccomp.Arch.X86_64, pyseccomp.Arch.AARCH64)
    unknown = [n for n in sf.ALLOWED + sf.DENIED if all(pyseccomp.resolve_syscall(a, n) == -1 for a in arches)]
    assert unknown == []  # -1: no such name on any architecture libseccomp knows (a typo)
    assert len(set(sf.ALLOWED)) == len(sf.ALLOWED) and not set(sf.ALLOWED) & set(sf.DENIED)
    assert set(MUST_DENY) <= set(sf.DENIED)
    assert not {"clone", "clone3", "personality", "socket", *sf.MEMFD} & set(sf.ALLOWED)  # by argument or setting


def test_ordinary_programs_run_under_the_filter(pool):
    """What a test program may use: threads, a process pool (fork, POSIX semaphores in /dev/shm), a queue,
    temporary files, anonymous mmap, a subprocess."""
    code = (
        "import concurrent.futures, mmap, multiprocessing, os, subprocess, sys, tempfile, threading\n"
        "def f():\n"
        "    out = []\n"
        "    t = threading.Thread(target=lambda: out.append(1))\n"
        "    t.start()\n"
        "    t.join()\n"
        "    with concurrent.futures.ThreadPoolExecutor(2) as ex:\n"
        "        out += list(ex.map(abs, [-2, -3]))\n"
        "    with multiprocessing.Pool(2) as p:\n"
        "        out += p.map(abs, [-4, -5])\n"
        "    q = multiprocessing.Queue()\n"
        "    q.put(6)\n"
        "    out.append(q.get())\n"
        "    with tempfile.NamedTemporaryFile() as fh:\n"
        "        fh.write(b'x' * 7)\n"
        "        fh.flush()\n"
        "        out.append(os.path.getsize(fh.name))\n"
        "    m = mmap.mmap(-1, 1 << 20)\n"
        "    m[0] = 8\n"
        "    out.append(m[0])\n"
        "    run = subprocess.run([sys.executable, '-c', 'print(9)'], capture_output=True, text=True)\n"
        "    return out + [int(run.stdout)]\n"
    )
    v = judge(pool, Program(code, "call", tests=("assert f() == [1, 2, 3, 4, 5, 6, 7, 8, 9]",)), 20.0)
    assert (v.passed, v.failure) == (True, None)


def test_protections_are_reported(pool):
    from rl_training.sandbox.confinement import PoolSettings, confine, delegated_cgroup

    cgroup, why = delegated_cgroup()
    assert cgroup is None  # this machine (docs: cgroups are not delegated); the stand-in test covers the rest
    assert pool.protections.as_dict() == {
        "mode": "strict",
        "namespaces": True,
        "uid": 65534,
        "seccomp": True,
        "seccomp_allowed": len(sf.native_numbers(sf.ALLOWED)) + 4,  # + clone, personality, socket by argument
        "seccomp_refusal": "EPERM",
        "seccomp_denied": tuple(sf.native_numbers(sf.DENIED)),
        "memory": "memfd-denied+shm-in-tmpfs",
        "memory_note": f"no memory cgroup: {why}",
        "tmp_bytes": 48 << 20,
        "shm_bytes": 16 << 20,
    }
    line = pool.protections.summary()
    assert line.startswith("mode strict, namespaces on, uid 65534, seccomp on (") and "the rest EPERM" in line
    assert "memory memfd-denied+shm-in-tmpfs (no memory cgroup: " in line and line.endswith("+ 16 MiB /dev/shm")
    weak = confine(PoolSettings(mode="weak"))[1]
    assert (weak.namespaces, weak.seccomp, weak.memory, weak.tmp_bytes) == (False, False, "rlimits-only", 0)
    off = confine(PoolSettings(seccomp=False))[1]
    assert (off.namespaces, off.seccomp, off.seccomp_denied, off.memory) == (True, False, (), "rlimits-only")


def test_memory_cgroup_detection_says_why_not_here():
    from rl_training.sandbox.confinement import delegated_cgroup

    # cgroup v1 holds the memory controller here; the v2 hierarchy (hybrid) has none
    why = "cgroups are not delegated: no memory controller in /sys/fs/cgroup/unified (hugetlb)"
    assert delegated_cgroup() == (None, why)


def test_memory_cgroup_path_logic_on_a_stand_in(tmp_path, pool):
    """A temporary directory stands in for a delegated cgroup v2 subtree: the detection reads it as the kernel
    lays it out, and a worker started under it is moved into its own cgroup before bwrap runs."""
    from rl_training.sandbox.confinement import Confinement, PoolSettings, delegated_cgroup
    from rl_training.sandbox.handle import Worker

    mount, proc, info = tmp_path / "cgroup2", tmp_path / "proc-self-cgroup", tmp_path / "mountinfo"
    d = mount / "job" / "step"
    d.mkdir(parents=True)
    proc.write_text("0::/job/step\n")
    info.write_text(f"30 23 0:27 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n")
    (d / "cgroup.controllers").write_text("cpu memory pids\n")
    (d / "cgroup.subtree_control").write_text("cpu\n")
    detect = lambda: delegated_cgroup(str(proc), str(info))  # noqa: E731
    assert detect() == (None, f"cgroups are not delegated: memory is not in {d}/cgroup.subtree_control")
    (d / "cgroup.subtree_control").write_text("cpu memory\n")
    assert detect() == (d, f"delegated: {d}")
    info.write_text(f"30 23 0:27 /job {mount / 'job'} rw - cgroup2 cgroup2 rw\n")  # a subtree mounted
    assert detect() == (d, f"delegated: {d}")
    (d / "cgroup.controllers").write_text("cpu pids\n")
    assert detect() == (None, f"cgroups are not delegated: no memory controller in {d} (cpu pids)")
    info.write_text("25 1 0:22 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert detect() == (None, f"no cgroup2 file system in {info}")
    proc.write_text("4:memory:/job\n")
    assert detect() == (None, f"no cgroup v2 entry in {proc} (cgroup v1 only)")

    w = Worker(PoolSettings(workers=1), pool.python, Confinement(pool.confinement.bpf, d, 300 << 20))
    try:
        assert w.cgroup.parent == d and w.cgroup.name.startswith(f"rl-sandbox-{os.getpid()}-")
        assert (w.cgroup / "memory.max").read_text() == str(300 << 20)
        assert (w.cgroup / "cgroup.procs").read_text() == str(w.proc.pid)  # written while the child waited
        assert Path(f"/proc/{w.proc.pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/bwrap")  # then exec
        assert w.request({"op": "ping"}, 5.0) == {"op": "pong"}
    finally:
        for f in w.cgroup.iterdir():  # a real cgroup's interface files go with it; the stand-in's do not
            f.unlink()
        w.close()
    assert not w.cgroup.exists()


def test_strict_mode_refuses_without_libseccomp(monkeypatch):
    import sys

    from rl_training.sandbox.confinement import PoolSettings, SandboxUnavailable, confine
    from rl_training.sandbox.pool import Pool

    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # as where the binding is not installed: ImportError
    with pytest.raises(SandboxUnavailable, match=r"libseccomp .*pip install -r requirements.txt.*sandbox.mode=weak"):
        Pool(PoolSettings(workers=1))
    assert confine(PoolSettings(mode="weak"))[1].seccomp is False  # the weak mode starts without it
