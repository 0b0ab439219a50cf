"""Hostile programs: each must score 0, leave no process behind and no file outside the sandbox, and leave
the trainer (this process) and the pool working.

Most programs try an attack and return the correct sum only if the attack got through, so a 0 means the
sandbox stopped it; the rest try to forge a pass (exit before the asserts, "passed" on stdout, objects
that equal anything, patched builtins, a walk up the stack, forged protocol frames).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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
    "kill_parent": "import os\ndef add(a, b):\n    os.kill(os.getppid(), 9)\n    return a + b\n",
    # pid 1 (bwrap's reaper) ignores signals from inside its namespace: nothing dies, the answer is wrong
    "kill_pid1": "import os, time\ndef add(a, b):\n    os.kill(1, 9)\n    time.sleep(0.1)\n    return None\n",
    "kill_everything": "import os\ndef add(a, b):\n    os.kill(-1, 9)\n    return a + b\n",
    "stop_parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGSTOP)\n    return a + b\n",
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
        "kill_parent": "sandbox_error",
        "stop_parent": "sandbox_error",
        "always_equal_object": "runtime_error",  # cannot cross the process boundary
        "always_equal_int_subclass": "wrong_answer",  # crossed as the plain int 7
        "print_passed": "wrong_answer",
        "sys_exit_before_asserts": "runtime_error",
    }
    assert {n: verdicts[n].failure for n in want} == want
    # the trainer runs on: the pool still grades, every worker is back to its idle processes only
    assert judge(pool, _program("def add(a, b):\n    return a + b\n"), 5.0).passed
    assert sorted(sandbox_processes(pool).values()) == [2, 2]
    assert [p for p in HOST_FILES if p.exists()] == []
    # 35 programs on 2 workers: 5 run into the 3 s deadline, the stopped template costs the 5 s reap limit;
    # the rest take milliseconds. Bounded, whatever the programs do (generous: the machine is shared).
    assert took < 90


def test_tmp_is_emptied_between_programs(pool):
    # 2 workers: 4 writers make sure each worker's /tmp had a file before the readers run
    write = _program("open('/tmp/state', 'w').write('5')\ndef add(a, b):\n    return 0\n")
    read = _program("import os\ndef add(a, b):\n    return a + b if os.path.exists('/tmp/state') else -1\n")
    assert [v.passed for v in judge_batch(pool, [write] * 4 + [read] * 4, 3.0)] == [False] * 8
