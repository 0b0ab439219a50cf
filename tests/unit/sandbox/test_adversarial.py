"""Hostile programs: each must score 0, leave no process behind and no file outside the sandbox, and leave
the trainer (this process) and the pool working.

Most programs try an attack and return the correct sum only if the attack got through, so a 0 means the
sandbox stopped it; the rest try to forge a pass (exit before the asserts, "passed" on stdout, objects
that equal anything, patched builtins, a walk up the stack, forged protocol frames).
"""

from __future__ import annotations

import errno
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_training.sandbox import seccomp_filter, worker
from rl_training.sandbox.confinement import Limits, PoolSettings
from rl_training.sandbox.pool import Pool
from rl_training.tasks.code import harness
from rl_training.tasks.code.harness import Program, judge, judge_batch
from tests.helpers import sandbox_processes

CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
MARK = f"pwned-{os.getpid()}"
HOST_FILES = [Path("/tmp") / MARK, Path.cwd() / MARK, Path("/work") / MARK, Path("/dev/shm") / MARK]

# name -> the program (defines add(a, b)); `OK` is the correct answer, returned only if the attack worked.
HOSTILE = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass\n",
    "infinite_loop_at_import": "while True:\n    pass\n",
    "fork_bomb": "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n"
    "        except OSError:\n            pass\n",
    "allocate_10GB": "def add(a, b):\n    x = bytearray(10 * 2**30)\n    return a + b\n",
    "write_outside_tmp": "def add(a, b):\n    for d in ('/work', '/usr', '/', '/root'):\n"
    f"        try:\n            open(d + '/{MARK}', 'w').write('x')\n            return a + b\n"
    "        except OSError:\n            pass\n",
    "fill_dev": "def add(a, b):\n    for i in range(64):\n        open(f'/dev/f{i}', 'wb').write(b'0' * (8 << 20))\n"
    "    return a + b\n",
    "write_host_tmp_and_cwd": f"import os\ndef add(a, b):\n    open('/tmp/{MARK}', 'w').write('x')\n"
    f"    open('/dev/shm/{MARK}', 'w').write('x')\n    return 0\n",
    "huge_file": "def add(a, b):\n    with open('/tmp/big', 'wb') as f:\n        f.write(b'0' * (64 << 20))\n"
    "    return a + b\n",
    "network": "import socket\ndef add(a, b):\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
    "    return a + b\n",
    "network_localhost": "import socket\ndef add(a, b):\n    s = socket.socket()\n    s.settimeout(1)\n"
    "    s.connect(('127.0.0.1', 22))\n    return a + b\n",
    # The parent is the template, the sandbox's pid 1, which the kernel shields from every signal sent from inside
    # the namespace that it has no handler for: nothing dies, the answer is wrong (a dead template: sandbox_error).
    "kill_parent": "import os, time\ndef add(a, b):\n    os.kill(os.getppid(), 9)\n    time.sleep(0.1)\n"
    "    return None\n",
    "signal_pid1_with_everything": "import os, time\ndef add(a, b):\n    for s in range(1, 65):\n        try:\n"
    "            os.kill(1, s)\n        except OSError:\n            pass\n    time.sleep(0.1)\n    return None\n",
    "kill_everything": "import os, time\ndef add(a, b):\n    os.kill(-1, 9)\n    time.sleep(0.1)\n    return None\n",
    "stop_parent": "import os, signal, time\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGSTOP)\n"
    "    time.sleep(0.1)\n    return None\n",
    "signal_ignore_and_hang": "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGXCPU):\n"
    "    signal.signal(s, signal.SIG_IGN)\ndef add(a, b):\n    while True:\n        time.sleep(1)\n",
    "sys_exit_before_asserts": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "exit_in_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "override_builtins": "import builtins\nbuiltins.AssertionError = type('N', (Exception,), {})\n"
    "builtins.__import__ = None\ndef add(a, b):\n    return 0\n",
    "print_passed": "print('passed')\ndef add(a, b):\n    print('passed')\n    return None\n",
    "always_equal_object": "class E:\n    def __eq__(self, o):\n        return True\n"
    "    __ne__ = lambda s, o: False\n    __hash__ = object.__hash__\ndef add(a, b):\n    return E()\n",
    "always_equal_int_subclass": "class E(int):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return E(7)\n",
    "always_equal_str_subclass": "class E(str):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = str.__hash__\ndef add(a, b):\n    return E('x')\n",
    "stack_walk_forge": "import sys, gc\ndef add(a, b):\n    f = sys._getframe()\n    while f:\n"
    "        for v in list(f.f_locals.values()):\n            if isinstance(v, list):\n"
    "                v.append('passed')\n        f = f.f_back\n"
    "    for o in gc.get_objects():\n        if isinstance(o, list):\n            o.append('passed')\n"
    "    return None\n",
    "proc_memory_of_others": "import os\ndef add(a, b):\n    for p in os.listdir('/proc'):\n"
    "        if p.isdigit() and int(p) != os.getpid():\n            try:\n"
    "                with open(f'/proc/{p}/mem', 'rb') as f:\n                    f.seek(0x400000)\n"
    "                    f.read(16)\n                return a + b\n            except OSError:\n"
    "                pass\n",
    "ctypes_ptrace_parent": "import ctypes, os\ndef add(a, b):\n    libc = ctypes.CDLL(None)\n"
    "    if libc.ptrace(16, os.getppid(), 0, 0) == 0:\n        return a + b\n",
    "ctypes_segfault": "import ctypes\ndef add(a, b):\n    return ctypes.string_at(0)\n",
    "nested_user_namespace": "import ctypes\ndef add(a, b):\n    if ctypes.CDLL(None).unshare(0x10000000) == 0:\n"
    "        return a + b\n",
    "read_host_secrets": "import os\ndef add(a, b):\n"
    "    for p in ('/etc/shadow', '/etc/passwd', '/root/.bashrc', os.environ.get('HOME', '/nonexistent')):\n"
    "        if os.path.exists(p):\n            return a + b\n",
    "environment_leak": "import os\ndef add(a, b):\n    if os.environ.get('RL_SANDBOX_SECRET'):\n"
    "        return a + b\n",
    "huge_return_value": "def add(a, b):\n    return 'x' * (4 << 20)\n",  # over the 1 MiB reply cap
    "deeply_nested_return": "def add(a, b):\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
    "forged_protocol_frames": "import os, json, struct\ndef add(a, b):\n    m = json.dumps({'value': 5}).encode()\n"
    "    for fd in range(3, 64):\n        try:\n            os.write(fd, struct.pack('>I', len(m)) + m)\n"
    "        except OSError:\n            pass\n    return 1\n",
    "stray_background_process": "import os, time\ndef add(a, b):\n    if os.fork() == 0:\n        os.setsid()\n"
    "        while True:\n            time.sleep(1)\n    return None\n",
    "huge_stdout": "import sys\ndef add(a, b):\n    sys.stdout.write('passed\\n' * 10**7)\n    return 1\n",
}


def _program(code: str) -> Program:
    return Program(code, "call", tests=("check(candidate)",), trusted_setup=CHECK, entry_point="add")


def test_hostile_programs_score_zero_and_leave_nothing(pool, monkeypatch):
    monkeypatch.setenv("RL_SANDBOX_SECRET", "hunter2")  # the trainer's environment must not reach a program
    assert len(HOSTILE) >= 25
    t = time.monotonic()
    verdicts = dict(zip(HOSTILE, judge_batch(pool, [_program(c) for c in HOSTILE.values()], 3.0), strict=True))
    took = time.monotonic() - t
    assert {n: v for n, v in verdicts.items() if v.passed or v.fraction} == {}
    # the attacks were stopped for the reason we expect, not by accident
    want = {
        "infinite_loop": "timeout",
        "fork_bomb": "timeout",
        "allocate_10GB": "memory",
        "huge_return_value": "memory",
        "kill_parent": "wrong_answer",  # the template lived on
        "signal_pid1_with_everything": "wrong_answer",  # SIGINT too: the template has no handler for it
        "kill_everything": "runtime_error",  # ESRCH: no process to signal but pid 1, which kill(-1) skips
        "stop_parent": "wrong_answer",
        "always_equal_object": "runtime_error",  # cannot cross the process boundary
        "always_equal_int_subclass": "wrong_answer",  # crossed as the plain int 7
        "print_passed": "wrong_answer",
        "sys_exit_before_asserts": "runtime_error",
    }
    assert {n: verdicts[n].failure for n in want} == want
    # the trainer runs on: the pool still grades, every worker is back to its idle processes only
    assert judge(pool, _program("def add(a, b):\n    return a + b\n"), 5.0).passed
    assert sorted(sandbox_processes(pool).values()) == [1, 1]  # the template, the sandbox's pid 1
    assert [p for p in HOST_FILES if p.exists()] == []
    # 35 programs on 2 workers: 5 run into the 3 s deadline, the rest take milliseconds. Bounded, whatever the
    # programs do (generous: the machine is shared).
    assert took < 90


def test_tmp_is_emptied_between_programs(pool):
    # 2 workers: 4 writers make sure each worker's /tmp had a file before the readers run
    write = _program("open('/tmp/state', 'w').write('5')\ndef add(a, b):\n    return 0\n")
    read = _program("import os\ndef add(a, b):\n    return a + b if os.path.exists('/tmp/state') else -1\n")
    assert [v.passed for v in judge_batch(pool, [write] * 4 + [read] * 4, 3.0)] == [False] * 8


# -------------------------------------------------------------------------------------------------- pid 1
# Without a ptrace call (the filter refuses those): /proc/<pid>/mem opened for writing, environ and maps read, of
# pid 1 and of the template (the same process: bwrap --as-pid-1); and the filter mode of every process inside.
PID1_PROBE = r"""
import errno, os

def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]

def probe():
    out = {"ppid": os.getppid()}
    for who, pid in (("pid1", 1), ("template", os.getppid())):
        out[who] = {
            "mem_write": _try(lambda: os.close(os.open(f"/proc/{pid}/mem", os.O_WRONLY))),
            "environ": _try(lambda: open(f"/proc/{pid}/environ", "rb").read()),
            "maps": _try(lambda: open(f"/proc/{pid}/maps").read()),
        }
    status = {int(p): open(f"/proc/{p}/status").read().splitlines() for p in os.listdir("/proc") if p.isdigit()}
    out["seccomp"] = {p: [x.split()[1] for x in lines if x.startswith("Seccomp:")][0] for p, lines in status.items()}
    return out
"""


def test_no_process_of_the_sandbox_is_dumpable_or_unfiltered(pool, monkeypatch):
    """pid 1 is the template (not dumpable, filtered), so a program can neither write code into a process that
    outlives the reap nor read another's memory. The control: bwrap's own pid 1 (without --as-pid-1) is dumpable,
    and a program of the same uid opens its memory for writing (and so could run code there that outlives the
    reap and reaches the worker's next program)."""
    from rl_training.sandbox import handle

    got, ran = _call(pool, PID1_PROBE, "probe")
    refused = {"mem_write": "EACCES", "environ": "EACCES", "maps": "EACCES"}
    assert ran.clean and got["ppid"] == 1 and got["pid1"] == got["template"] == refused
    assert got["seccomp"] == {1: "2", max(got["seccomp"]): "2"}  # the template and the program, both filtered
    for w in list(pool._idle):  # from the trusted side: one process inside each idle worker, filtered, pid 1 there
        (inner,) = worker.descendants(w.proc.pid)
        status = dict(x.split(":", 1) for x in Path(f"/proc/{inner}/status").read_text().splitlines())
        assert (status["Seccomp"].strip(), status["NSpid"].split()[-1]) == ("2", "1")

    real = handle.bwrap_argv
    monkeypatch.setattr(handle, "bwrap_argv", lambda *a, **k: [x for x in real(*a, **k) if x != "--as-pid-1"])
    with Pool(PoolSettings(workers=1)) as old:
        got, _ = _call(old, PID1_PROBE, "probe")
    assert got["ppid"] == 2 and got["template"] == refused
    assert got["pid1"] == {"mem_write": "ok", "environ": "ok", "maps": "ok"}


# ------------------------------------------------------------------------------- the system-call filter
# Each denied family tried with x86_64 numbers, with arguments chosen so that the kernel's own answer (without the
# filter) differs from a refusal wherever it can: a bad address (EFAULT) or fd (EBADF) is seen before most checks.
SYSCALL_PROBE = r"""
import ctypes, errno, os

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
BAD, NUL = ctypes.c_void_p(1), ctypes.c_void_p(0)


def sc(nr, *args, close=False):
    r = libc.syscall(ctypes.c_long(nr), *args)
    if r < 0:
        return errno.errorcode[ctypes.get_errno()]
    if close:
        os.close(r)
    return "ok"


def probe():
    ipc = 0o1000 | 0o600  # IPC_CREAT | 0600, key IPC_PRIVATE
    return {
        "io_uring_setup": sc(425, 1, ctypes.create_string_buffer(120), close=True),
        "io_uring_enter": sc(426, -1, 0, 0, 0, NUL, 0),
        "io_uring_register": sc(427, -1, 0, NUL, 0),
        "keyctl": sc(250, 0, -2, 1),  # KEYCTL_GET_KEYRING_ID of the process keyring, created
        "add_key": sc(248, b"user", b"k", b"v", 1, -2),
        "request_key": sc(249, b"user", b"missing", NUL, 0),
        "bpf": sc(321, 0, NUL, 0),
        "userfaultfd": sc(323, 1, close=True),  # UFFD_USER_MODE_ONLY: open to the unprivileged
        "perf_event_open": sc(298, NUL, 0, -1, -1, 0),
        "ptrace": sc(101, 7, 999999, 0, 0),  # PTRACE_CONT of no such process
        "process_vm_readv": sc(310, os.getpid(), NUL, 0, NUL, 0, 0),
        "process_vm_writev": sc(311, os.getpid(), NUL, 0, NUL, 0, 0),
        "mount": sc(165, NUL, BAD, NUL, 0, NUL),
        "umount2": sc(166, BAD, 0),
        "pivot_root": sc(155, BAD, BAD),
        "open_tree": sc(428, -100, BAD, 0),
        "move_mount": sc(429, -1, b"", -1, b"", 0),
        "fsopen": sc(430, BAD, 0),
        "fsconfig": sc(431, -1, 0, NUL, NUL, 0),
        "fsmount": sc(432, -1, 0, 0),
        "fspick": sc(433, -100, BAD, 0),
        "unshare": sc(272, 0x10000000),  # CLONE_NEWUSER
        "setns": sc(308, -1, 0),
        "clone_newuser": sc(56, 0x10000000 | 17, 0, 0, 0, 0),  # CLONE_NEWUSER | SIGCHLD
        "clone3": sc(435, NUL, 0),
        "init_module": sc(175, NUL, 0, b""),
        "finit_module": sc(313, -1, b"", 0),
        "delete_module": sc(176, BAD, 0),
        "kexec_load": sc(246, 0, 0, NUL, 0),
        "kexec_file_load": sc(320, -1, -1, 0, NUL, 0),
        "reboot": sc(169, 0, 0, 0, NUL),  # wrong magic numbers
        "swapon": sc(167, BAD, 0),
        "swapoff": sc(168, BAD),
        "acct": sc(163, BAD),
        "quotactl": sc(179, 0, BAD, 0, NUL),
        "lookup_dcookie": sc(212, 0, NUL, 0),
        "personality": sc(135, 0x0400000),  # READ_IMPLIES_EXEC: not one of Docker's values
        "syslog": sc(103, 10, NUL, 0),  # SYSLOG_ACTION_SIZE_BUFFER
        "settimeofday": sc(164, BAD, NUL),
        "clock_settime": sc(227, 0, BAD),
        "adjtimex": sc(159, BAD),
        "iopl": sc(172, 0),
        "ioperm": sc(173, 0, 0, 0),
        "name_to_handle_at": sc(303, -100, b"/tmp", BAD, BAD, 0),
        "open_by_handle_at": sc(304, -100, BAD, 0),
        "memfd_create": sc(319, b"x", 0, close=True),
        "shmget": sc(29, 0, 4096, ipc),
        "msgget": sc(68, 0, ipc),
        "semget": sc(64, 0, 1, ipc),
        "mq_open": sc(240, b"probe", 0o100 | 2, 0o600, NUL, close=True),
        "socket_vsock": sc(41, 40, 1, 0, close=True),  # AF_VSOCK, SOCK_STREAM: created, never connected
        # times set to now (NULL): write permission is enough; the sandbox's own /tmp, never a host node
        "utime": sc(132, b"/tmp", NUL),
        "utimes": sc(235, b"/tmp", NUL),
        "futimesat": sc(261, -100, b"/tmp", NUL),
        "utimensat": sc(280, -100, b"/tmp", NUL, 0),
    }
"""
# What this kernel (6.18, no modules, no x86 port I/O, no lookup_dcookie) answers without the filter, in the
# sandbox's namespaces as uid 65534 without capabilities: these got through.
OPEN_WITHOUT_FILTER = {
    "io_uring_setup",
    "keyctl",
    "add_key",
    "userfaultfd",
    "personality",
    "memfd_create",
    "shmget",
    "msgget",
    "semget",
    "mq_open",
    "socket_vsock",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
}
# ... and these the kernel refuses by itself (no capability): here only the marked filter shows it refuses them too
EPERM_WITHOUT_FILTER = {"pivot_root", "move_mount", "fsopen", "fsmount", "fspick", "reboot", "swapon", "swapoff"}
EPERM_WITHOUT_FILTER |= {"acct", "syslog"}
BY_NUMBER = r"""
import ctypes, errno

libc = ctypes.CDLL(None, use_errno=True)

def refused(numbers):
    return {name: "ok" if libc.syscall(nr, 0, 0, 0, 0, 0, 0) >= 0 else errno.errorcode[ctypes.get_errno()]
            for name, nr in numbers.items()}
"""
x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the probes use x86_64 system-call numbers")


def _call(pool, code: str, fn: str, *args, limits=None):
    """fn(*args) of a program run in the pool: (its value or None, the Ran)."""
    got = {}

    def drive(job):
        s = harness._Session(job)
        assert s.ask({"code": code, "name": "candidate", "setup": ""}) == {"ok": True}
        try:
            got["value"] = harness._Remote(s, fn)(*args)
        except harness._Fatal:  # the candidate died (a kill by the filter) or timed out
            pass

    ran = pool.run(drive, 10.0, limits)
    return got.get("value"), ran


@x86_64
def test_denied_system_calls_get_eperm_and_the_filter_is_why(pool):
    got, _ = _call(pool, SYSCALL_PROBE, "probe")
    assert got == {name: "ENOSYS" if name == "clone3" else "EPERM" for name in got}  # clone3: glibc falls back
    assert len(got) == 55
    # The control: the same program without the filter, where the kernel's own answers show what got through.
    with Pool(PoolSettings(workers=1, seccomp=False)) as open_pool:
        assert open_pool.protections.seccomp is False
        raw, _ = _call(open_pool, SYSCALL_PROBE, "probe")
    assert {n for n, r in raw.items() if r == "ok"} == OPEN_WITHOUT_FILTER
    assert {n for n, r in raw.items() if r == "EPERM"} == EPERM_WITHOUT_FILTER
    # A filter refusing with an errno no call returns by itself (ENOTRECOVERABLE): each refusal above is the filter's.
    with Pool(PoolSettings(workers=1, seccomp_errno=errno.ENOTRECOVERABLE)) as marked:
        assert marked.protections.seccomp_refusal == "ENOTRECOVERABLE"
        mark, _ = _call(marked, SYSCALL_PROBE, "probe")
        assert mark == {name: "ENOSYS" if name == "clone3" else "ENOTRECOVERABLE" for name in got}
        # every denial the pool reports, by this architecture's number, with zero arguments (never run unfiltered)
        numbers = seccomp_filter.native_numbers(list(marked.protections.seccomp_denied))
        assert len(numbers) == len(seccomp_filter.DENIED) == 80
        assert _call(marked, BY_NUMBER, "refused", numbers)[0] == dict.fromkeys(numbers, "ENOTRECOVERABLE")
    assert _call(pool, BY_NUMBER, "refused", numbers)[0] == dict.fromkeys(numbers, "EPERM")


DEVICES = [f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom", "tty")]  # the host's, bound in
UTIME = r"""
import errno, io, os, pathlib, shutil, tarfile, time

def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]

def times(devices):
    out = {"touch_" + d: _try(lambda: os.utime(d, None)) for d in devices}  # now: write permission is enough
    pathlib.Path("/tmp/old").write_text("x")
    out["utime"] = _try(lambda: os.utime("/tmp/old", (0, 0)))
    out["copy2"] = _try(lambda: shutil.copy2("/tmp/old", "/tmp/copy"))  # copystat sets the times
    before = os.stat("/tmp/old").st_mtime_ns
    time.sleep(0.01)
    pathlib.Path("/tmp/old").touch()  # tries os.utime, then opens with O_CREAT: no error, the old time stays
    out["touch_existing_keeps_its_time"] = os.stat("/tmp/old").st_mtime_ns == before
    pathlib.Path("/tmp/new").touch()
    out["touch_new"] = os.path.exists("/tmp/new")
    buf, member = io.BytesIO(), tarfile.TarInfo("t/f")
    member.size, member.mtime = 1, 86400
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(member, io.BytesIO(b"y"))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        tar.extractall("/tmp")  # errorlevel 1: the refused utime is logged, not raised
    out["tar"] = (open("/tmp/t/f").read(), os.stat("/tmp/t/f").st_mtime > 86400)
    return out
"""


def test_device_times_cannot_be_set_and_what_that_costs(pool):
    """The filter refuses the utime family: the host's device nodes, bound into every sandbox, keep their times (a
    channel between any two programs of the node otherwise, fresh sandboxes included). What programs lose: os.utime
    and shutil.copy2 fail with EPERM; Path.touch of an existing file leaves its time; tarfile extracts without the
    members' times."""
    host = {d: os.stat(d).st_mtime_ns for d in DEVICES}
    got, ran = _call(pool, UTIME, "times", DEVICES)
    assert ran.clean and got == {
        **{"touch_" + d: "EPERM" for d in DEVICES},
        "utime": "EPERM",
        "copy2": "EPERM",
        "touch_existing_keeps_its_time": True,
        "touch_new": True,
        "tar": ("y", True),
    }
    assert {d: os.stat(d).st_mtime_ns for d in DEVICES} == host


# mov eax, NR; int 0x80 (the i386 ABI) or syscall with the x32 bit; ret. getpid on both ABIs.
FOREIGN_ABI = r"""
import ctypes, mmap

def call(code):
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()

def i386():
    return call(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")

def x32():
    return call(b"\xb8\x27\x00\x00\x40\x0f\x05\xc3")
"""


@x86_64
def test_foreign_system_call_abis_kill_the_program(pool):
    """libseccomp with only the native architecture added: an i386 (int 0x80) or x32 call is the bad-architecture
    action, a kill (SIGSYS). Without the filter this kernel answers the i386 getpid and has no x32 (ENOSYS)."""
    for fn in ("i386", "x32"):
        value, ran = _call(pool, FOREIGN_ABI, fn)
        assert value is None and ran.clean and os.WIFSIGNALED(ran.status)
        assert os.WTERMSIG(ran.status) == signal.SIGSYS
    with Pool(PoolSettings(workers=1, seccomp=False)) as open_pool:
        pid, _ = _call(open_pool, FOREIGN_ABI, "i386")
        assert pid > 1  # the candidate's pid in the sandbox's namespace
        assert _call(open_pool, FOREIGN_ABI, "x32")[0] == -errno.ENOSYS


@x86_64
def test_a_program_the_filter_kills_is_reported_as_killed_under_load(pool):
    """The kill's status survives the race between the trusted side seeing the job socket close and the program
    becoming waitable. Read with WNOHANG at that moment (the old reap), the program was sometimes still exiting
    and its status was lost: under 4 busy loops on 2 cores, 1 to 17 of 1000 calls (six runs; a few in 300 in
    the module's own test, once); none without load. The reap now takes the status its own wait collects, which
    the kill it sends cannot replace. About 6 s."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        statuses = [_call(pool, FOREIGN_ABI, "i386" if i % 2 else "x32")[1].status for i in range(1000)]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    lost = sum(s is None for s in statuses)
    assert lost == 0 and {os.WTERMSIG(s) for s in statuses} == {signal.SIGSYS}, f"{lost} of 1000 lost"


MEMFD_HOG = r"""
import errno, os

def hog(mib=1024):
    # 16 MiB a memfd (RLIMIT_FSIZE bounds one file), held open; none of it is address space for RLIMIT_AS
    fds, chunk = [], b"x" * (1 << 20)
    try:
        while len(fds) * 16 < mib:
            fds.append(os.memfd_create("hog"))
            for _ in range(16):
                os.write(fds[-1], chunk)
    except OSError as e:
        return errno.errorcode[e.errno], len(fds)
    return "held", sum(os.fstat(fd).st_size for fd in fds) >> 20
"""


def test_memfd_hog_is_refused(pool):
    """1 GB through memfd_create: EPERM at the first one. The control: without the filter a program under a
    128 MiB RLIMIT_AS holds 192 MiB in memfds, which is how two programs once took 1.7 GB of the host."""
    value, ran = _call(pool, MEMFD_HOG, "hog")
    assert (value, ran.clean) == (("EPERM", 0), True)
    with Pool(PoolSettings(workers=1, seccomp=False)) as open_pool:
        code = MEMFD_HOG + "\ndef hog192():\n    return hog(192)\n"
        assert _call(open_pool, code, "hog192", limits=Limits(mem_bytes=128 << 20))[0] == ("held", 192)


TMPFS_FILL = r"""
import errno, os

def fill(d):
    # 4 MiB files (RLIMIT_FSIZE bounds one file at 16 MiB) until the tmpfs is full
    total, chunk = 0, b"x" * (1 << 20)
    for i in range(1000):
        with open(f"{d}/fill{i}", "wb", buffering=0) as fh:
            for _ in range(4):
                try:
                    total += fh.write(chunk)
                except OSError as e:
                    return total >> 20, errno.errorcode[e.errno]
    return total >> 20, None
"""


def test_tmp_and_shm_share_one_budget(pool):
    """/tmp and /dev/shm (POSIX shared memory) are tmpfs, held in memory outside RLIMIT_AS: together they hold
    the worker's tmpfs budget (64 MiB: 48 + 16), not 64 MiB each."""
    tmp, shm = pool.protections.tmp_bytes >> 20, pool.protections.shm_bytes >> 20
    assert (tmp, shm, tmp + shm) == (48, 16, pool.settings.tmpfs_bytes >> 20)
    code = TMPFS_FILL + "\ndef shm():\n    return fill('/dev/shm')\ndef tmp():\n    return fill('/tmp')\n"
    assert _call(pool, code, "shm")[0] == (16, "ENOSPC")
    assert _call(pool, code, "tmp")[0] == (48, "ENOSPC")
