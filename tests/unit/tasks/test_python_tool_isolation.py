"""Issue 38, item 6: python-tool episodes are isolated. The members of a GRPO group share a prompt, so any state
one call leaves in the sandbox lets a completion hand its answer to another, a reward hack the trainer would
reinforce. Two episodes of one group: the first's cell writes a secret through every channel we could think of,
a later episode's cell (run after it, and one run beside it) reads every channel and reports what it found.

Each call runs in a sandbox started for it (sandbox/pool.py, PoolSettings.fresh). Before, a worker served
call after call and only emptied /tmp and /dev/shm in between, and the reader found: the secret in a chmod-000
directory and in a read-only one; the mode, access time and user.* extended attribute of /tmp and /dev/shm, their
inode counter and free space; the template's nice value, scheduling class, I/O priority and rlimits (set on the
parent, inherited by the next candidate); the oom_score_adj, coredump_filter and stack memory of bwrap's pid 1
(since gone: the template is pid 1, bwrap --as-pid-1, and is not dumpable); the pid counter; the ipc namespace's
writable sysctls (kernel/shmmax, msgmax, sem, pid_max, fs/mqueue/*). Fresh sandboxes left one channel, shared by
every sandbox of the node: the times of the host's /dev/null, zero, full, random, urandom and tty, bound into
each, which a program could set to now; the system-call filter now refuses the utime family."""

from __future__ import annotations

import json
import secrets
from types import SimpleNamespace

import pytest

from rl_training.config.schema import SandboxCfg
from rl_training.data.sources import Example
from rl_training.data.text import encode_plain
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.tasks.base import TaskContext, Turn
from rl_training.tasks.python_tool import PythonToolEnvironment
from tests.helpers import require_debian_packages

IM_END = 259  # the chat variant's end-of-turn id (tiny_model.py)
WHEN = 1_234_567_890  # the timestamp the writer plants (2009): no tmpfs made now has it
MODES = {"/tmp": 0o1713, "/dev/shm": 0o1731}  # the modes it plants on the two tmpfs roots

# What a fresh candidate inherits or can see without looking for a planted value: the reader takes it first
# thing, the writer before it plants anything; any difference is a channel (a fresh sandbox gives the same).
SNAPSHOT = r'''
import ctypes, json, os, platform, resource, socket, stat, time
_libc = ctypes.CDLL(None, use_errno=True)
_NR = {"x86_64": {"ioprio_get": 252, "ioprio_set": 251, "add_key": 248},
       "aarch64": {"ioprio_get": 31, "ioprio_set": 30, "add_key": 217}}[platform.machine()]
_mq_open = getattr(_libc, "mq_open", None) or ctypes.CDLL("librt.so.1", use_errno=True).mq_open  # glibc < 2.34
_mq_open.restype = ctypes.c_int
# the sysctls of the sandbox's own ipc, pid and uts namespaces (some writable from inside)
SYSCTL = ("kernel/hostname kernel/domainname kernel/shmmax kernel/shmall kernel/shmmni kernel/shm_rmid_forced "
          "kernel/msgmax kernel/msgmnb kernel/msgmni kernel/auto_msgmni kernel/sem kernel/shm_next_id "
          "kernel/msg_next_id kernel/sem_next_id kernel/ns_last_pid kernel/pid_max fs/mqueue/msg_max "
          "fs/mqueue/msgsize_max fs/mqueue/queues_max fs/mqueue/msg_default fs/mqueue/msgsize_default").split()

def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as e:
        return "error %d" % e.errno

def _try(fn, *a):
    try:
        return fn(*a)
    except OSError as e:
        return "error %d" % e.errno

def _proc(pid):
    """What a candidate can read of another process of its sandbox (pid 1: the template, its parent)."""
    rl = {n: _try(resource.prlimit, pid, getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}
    return {
        "nice": _try(os.getpriority, os.PRIO_PROCESS, pid),
        "affinity": _try(lambda: sorted(os.sched_getaffinity(pid))),
        "rlimits": rl,
        "ioprio": _libc.syscall(_NR["ioprio_get"], 1, pid),
        "sched": _try(os.sched_getscheduler, pid),
        **{f: _read("/proc/%d/%s" % (pid, f)) for f in ("comm", "oom_score_adj", "coredump_filter",
                                                         "timerslack_ns", "loginuid")},
    }

def _stack(pid):
    """(start, end) of a process's stack mapping: its lowest addresses are never used by a shallow program."""
    with open("/proc/%d/maps" % pid) as fh:  # OSError where the process is not dumpable
        line = [l for l in fh.read().splitlines() if l.endswith("[stack]")][0]
    return [int(a, 16) for a in line.split()[0].split("-")]

def _fs(path):
    st, vfs = os.lstat(path), os.statvfs(path)
    probe = os.path.join(path, ".probe-%d" % os.getpid())
    with open(probe, "w"):
        pass
    ino = os.stat(probe).st_ino  # the tmpfs's inode counter: it counts the files made before
    os.unlink(probe)
    return {"mode": oct(st.st_mode), "uid": st.st_uid, "gid": st.st_gid, "nlink": st.st_nlink, "next_ino": ino,
            "free": [vfs.f_bfree, vfs.f_ffree], "xattrs": _try(lambda: sorted(os.listxattr(path)))}

def snapshot():
    status = dict(l.split(":", 1) for l in _read("/proc/self/status").splitlines() if ":" in l)
    keep = ("Uid Gid Groups NoNewPrivs Seccomp CapInh CapPrm CapEff CapBnd CapAmb SigBlk SigIgn "
            "Cpus_allowed_list Mems_allowed_list").split()
    u = os.umask(0)
    os.umask(u)
    return {
        "pid": os.getpid(),  # the pid namespace's counter: it counts the processes made before
        "ppid": os.getppid(),
        "self": _proc(0),
        "parent": _proc(os.getppid()),
        "pid1": _proc(1),
        "status": {k: status.get(k, "").strip() for k in keep},
        "umask": u,
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "autogroup_nice": _read("/proc/self/autogroup").split()[-1],
        "personality": _libc.personality(0xFFFFFFFF),
        "sysctl": {p: _read("/proc/sys/" + p) for p in SYSCTL},
        "tmp": _fs("/tmp"),
        "shm": _fs("/dev/shm"),
        "tmp_entries": sorted(os.listdir("/tmp")),
        "shm_entries": sorted(os.listdir("/dev/shm")),
        "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "sysvipc": {k: _read("/proc/sysvipc/" + k).splitlines()[1:] for k in ("shm", "msg", "sem")},
        "unix_sockets": _read("/proc/net/unix").splitlines()[1:],
        "keys": _read("/proc/keys"),
        # host inodes bound into every sandbox: their times, set to now, would reach any later sandbox of the node
        "dev_times": {d: [os.stat(d).st_atime_ns, os.stat(d).st_mtime_ns, os.stat(d).st_ctime_ns] for d in
                      ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")},
    }
'''

WRITER = (
    SNAPSHOT
    + r"""
SECRET, WHEN, MODES, HOLD = "SECRET_", WHEN_, MODES_, HOLD_
before, done = snapshot(), {}

def plant(name, fn):
    try:
        fn()
        done[name] = True
    except OSError as e:
        done[name] = "error %d" % e.errno

def write(path, text=SECRET):
    with open(path, "w") as fh:
        fh.write(text)

def locked(root, mode):
    d = os.path.join(root, "locked-" + SECRET)
    os.mkdir(d)
    write(os.path.join(d, "secret"))
    os.setxattr(os.path.join(d, "secret"), "user.secret", SECRET.encode()) if mode == 0 else None
    os.chmod(d, mode)  # 000: nothing inside can be listed or removed; 555: nothing inside can be removed

for root in ("/tmp", "/dev/shm"):
    key = root.strip("/").replace("/", "_")
    plant(key + "_file", lambda: write(os.path.join(root, "secret-" + SECRET)))
    plant(key + "_dir_000", lambda: locked(root, 0))
    plant(key + "_dir_555", lambda: (os.mkdir(root + "/ro"), locked(root + "/ro", 0o555)))
    plant(key + "_fifo", lambda: os.mkfifo(os.path.join(root, "fifo-" + SECRET)))
    plant(key + "_symlink", lambda: os.symlink(SECRET, os.path.join(root, "link")))
    plant(key + "_socket", lambda: socket.socket(socket.AF_UNIX).bind(os.path.join(root, "sock-" + SECRET[:20])))
    plant(key + "_xattr", lambda: os.setxattr(root, "user.secret", SECRET.encode()))
    plant(key + "_utime", lambda: os.utime(root, (WHEN, WHEN)))
    plant(key + "_chmod", lambda: os.chmod(root, MODES[root]))
for where in ("/", "/dev", "/var/tmp", "/run", "/home", os.path.expanduser("~"), "/usr", "/proc", "/sys"):
    plant("file_in_" + where, lambda: write(os.path.join(where, "secret-" + SECRET)))
for dev in ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"):
    plant("utime_" + dev, lambda: os.utime(dev, (WHEN, WHEN)))  # a host inode shared by every sandbox
    plant("touch_" + dev, lambda: os.utime(dev, None))

# the process that outlives a candidate in a worker: the template, pid 1 and the parent (once also bwrap's pid 1)
def lower(pid, name):
    which = getattr(resource, name)
    resource.prlimit(pid, which, (12345, resource.prlimit(pid, which)[1]))

def nicer(which, who):
    return min(19, os.getpriority(which, who) + 1)

def ok(rc):
    if rc < 0:
        raise OSError(ctypes.get_errno(), "")

for who, pid in (("parent", os.getppid()), ("pid1", 1)):
    # one step nicer than now: a process may raise its nice value, not lower it (under `nice -n 10` a 7 was refused)
    plant(who + "_nice", lambda: os.setpriority(os.PRIO_PROCESS, pid, nicer(os.PRIO_PROCESS, pid)))
    for n in ("RLIMIT_STACK", "RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING", "RLIMIT_MEMLOCK", "RLIMIT_NOFILE"):
        plant(who + "_" + n, lambda: lower(pid, n))
    plant(who + "_affinity", lambda: os.sched_setaffinity(pid, {min(os.sched_getaffinity(pid))}))
    plant(who + "_ioprio", lambda: ok(_libc.syscall(_NR["ioprio_set"], 1, pid, 3 << 13)))  # the idle class
    plant(who + "_sched", lambda: os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0)))
    for f, v in (("comm", SECRET[:15]), ("oom_score_adj", "777"), ("coredump_filter", "0x7"),
                 ("timerslack_ns", "4242")):
        plant(who + "_" + f, lambda: write("/proc/%d/%s" % (pid, f), v))
def poke(pid):  # bwrap's own pid 1 was dumpable: the program (same uid) could write its memory
    fd = os.open("/proc/%d/mem" % pid, os.O_RDWR)
    os.pwrite(fd, SECRET.encode(), _stack(pid)[0] + 256)
    os.close(fd)
plant("pid1_memory", lambda: poke(1))
plant("parent_memory", lambda: poke(os.getppid()))  # the template is not dumpable
plant("autogroup_nice", lambda: write("/proc/self/autogroup", "17"))
plant("pgrp_nice", lambda: os.setpriority(os.PRIO_PGRP, 0, nicer(os.PRIO_PGRP, 0)))
plant("user_nice", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19))
plant("hostname", lambda: socket.sethostname(SECRET[:20]))
for p in SYSCTL:
    plant("sysctl_" + p, lambda: write("/proc/sys/" + p, "1" if p.endswith("rmid_forced") else "4242"))
os.environ["SECRET"] = SECRET
os.umask(0o077)

# SysV IPC with a fixed key, POSIX message queues, the kernel keyring
_libc.shmget.restype = _libc.msgget.restype = _libc.semget.restype = ctypes.c_int
plant("sysv_shm", lambda: ok(_libc.shmget(0x5EC, 4096, 0o1666)))  # IPC_CREAT | 0666
plant("sysv_msg", lambda: ok(_libc.msgget(0x5EC, 0o1666)))
plant("sysv_sem", lambda: ok(_libc.semget(0x5EC, 1, 0o1666)))
plant("mqueue", lambda: ok(_mq_open(b"/secret", os.O_CREAT | os.O_WRONLY, 0o666, None)))
plant("keyring", lambda: ok(_libc.syscall(_NR["add_key"], b"user", b"rl-secret", SECRET.encode(), len(SECRET), -4)))

# the pid counter: 40 processes made and gone
def forks():
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
plant("pid_counter", forks)

# what lives only while its process does: an abstract socket name, a daemon, a listening port
held = socket.socket(socket.AF_UNIX)
plant("abstract_socket", lambda: (held.bind("\0rl-secret-" + SECRET), held.listen()))
def daemon():
    if os.fork() == 0:
        os.setsid()
        time.sleep(30)
        os._exit(0)
plant("daemon", daemon)
tcp = socket.socket()
plant("tcp_port", lambda: (tcp.bind(("127.0.0.1", 4242)), tcp.listen()))
print(json.dumps({"before": before, "done": done, "held": [time.time(), time.time() + HOLD]}))
time.sleep(HOLD)  # > 0: the reader runs meanwhile
"""
)

READER = (
    SNAPSHOT
    + r'''
SECRET, WHEN, MODES, WAIT = "SECRET_", WHEN_, MODES_, WAIT_
time.sleep(WAIT)  # > 0: the writer has planted and holds on
now, found = snapshot(), {}

def walk(root):
    """Every entry under root whose name, link or content holds the secret; a locked directory is opened."""
    hits = []
    for d, dirs, files in os.walk(root):
        for name in dirs:
            p = os.path.join(d, name)
            if not os.access(p, os.R_OK | os.X_OK):
                try:
                    os.chmod(p, 0o700)
                except OSError:
                    pass
        for name in dirs + files:
            p = os.path.join(d, name)
            if SECRET in name or (os.path.islink(p) and SECRET in os.readlink(p)):
                hits.append(p)
            elif os.path.isfile(p) and not os.path.islink(p):
                try:
                    with open(p, errors="replace") as fh:
                        if SECRET in fh.read(1 << 16):
                            hits.append(p)
                except OSError:
                    pass
            try:
                if any(SECRET.encode() in os.getxattr(p, a) for a in os.listxattr(p, follow_symlinks=False)):
                    hits.append(p + " (xattr)")
            except OSError:
                pass
    return hits or None

found["files"] = (walk("/tmp") or []) + (walk("/dev/shm") or []) or None
elsewhere = [r for r in os.listdir("/") if r not in ("proc", "sys", "usr", "bin", "lib", "lib64", "sbin", "tmp")]
found["files_elsewhere"] = [h for r in elsewhere for h in walk("/" + r) or []] or None
for root, key in (("/tmp", "tmp"), ("/dev/shm", "shm")):
    st = os.stat(root)
    found[key + "_times"] = [st.st_atime, st.st_mtime] if WHEN in (int(st.st_atime), int(st.st_mtime)) else None
    found[key + "_mode"] = oct(st.st_mode) if st.st_mode & 0o7777 == MODES[root] else None
    found[key + "_xattr"] = _try(os.getxattr, root, "user.secret")
    found[key + "_xattr"] = found[key + "_xattr"].decode() if isinstance(found[key + "_xattr"], bytes) else None
def peek(pid):
    try:
        lo, hi = _stack(pid)
        fd = os.open("/proc/%d/mem" % pid, os.O_RDONLY)
    except OSError:  # not dumpable: nothing of it can be read, and nothing could be planted there
        return None
    try:
        at = os.pread(fd, hi - lo, lo).find(SECRET.encode())
    finally:
        os.close(fd)
    return None if at < 0 else "at %#x" % (lo + at)
found["pid1_memory"] = peek(1)
found["environ"] = os.environ.get("SECRET")
found["hostname"] = socket.gethostname() if SECRET[:20] in socket.gethostname() else None
found["unix_sockets"] = [l for l in now["unix_sockets"] if "rl-secret" in l or "sock-" in l] or None
s = socket.socket(socket.AF_UNIX)
found["abstract_socket"] = "connected" if _try(s.connect, "\0rl-secret-" + SECRET) is None else None
t = socket.socket()
t.settimeout(0.2)
found["tcp_port"] = "connected" if _try(t.connect, ("127.0.0.1", 4242)) is None else None
found["keys"] = now["keys"] if "rl-secret" in now["keys"] else None
_libc.shmget.restype = _libc.msgget.restype = _libc.semget.restype = ctypes.c_int
for name, rc in (("sysv_shm", _libc.shmget(0x5EC, 0, 0)), ("sysv_msg", _libc.msgget(0x5EC, 0)),
                 ("sysv_sem", _libc.semget(0x5EC, 0, 0)), ("mqueue", _mq_open(b"/secret", os.O_RDONLY))):
    found[name] = rc if rc >= 0 else None
print(json.dumps({"now": now, "found": found, "at": time.time()}))
'''
)


def cell(src: str, secret: str, **values) -> str:
    src = src.replace('"SECRET_"', repr(secret)).replace("WHEN_", str(WHEN)).replace("MODES_", repr(MODES))
    for k, v in values.items():
        src = src.replace(f"{k}_", repr(v))
    return src


def py(code: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": {json.dumps(code)}}}}}</tool_call>'


@pytest.fixture(scope="module")
def env():
    require_debian_packages({"bwrap": "bubblewrap"})
    tok = build_tokenizer(chat=True)
    ctx = TaskContext(tokenizer=tok, cfg=SimpleNamespace(sandbox=SandboxCfg(workers=2)))
    e = PythonToolEnvironment(output_chars=1 << 17, max_obs_tokens=1 << 18, tool_timeout_s=10.0)
    e.start(ctx)
    e.tok = tok
    yield e
    e.close()


def step(env, eps, codes) -> list[dict]:
    """One turn of each episode (run in parallel over the pool, as a batch runs), its one result as JSON."""
    stats = env.call_stats()
    turns = []
    for code in codes:
        ids = [*encode_plain(env.tok, py(code)), IM_END]
        turns.append(Turn(env.tok.decode(ids, skip_special_tokens=True), ids, 1, True, False))
    out = []
    for s in env.step_batch(eps, turns, stats):
        text = env.tok.decode(s.observation).split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        assert text.startswith("{"), text  # not a traceback or an error
        out.append(json.loads(text))
    return out


def leaks(writer: dict, reader: dict) -> dict:
    """channel -> what the reader saw of the writer: a planted value it found, or a part of the fresh state it
    saw changed (the writer's state before it planted anything is what a fresh sandbox shows)."""
    out = {k: v for k, v in reader["found"].items() if v is not None}
    before, now = writer["before"], reader["now"]
    for k in before:
        if isinstance(before[k], dict):
            out |= {f"{k}.{kk}": now[k][kk] for kk in before[k] if now[k][kk] != before[k][kk]}
        elif now[k] != before[k]:
            out[k] = now[k]
    return out


def test_no_channel_between_the_episodes_of_a_group(env):
    """The reader finds nothing of the writer, run after it (the pool's two workers: on a reused pool it lands on
    the writer's worker) and run beside it."""
    ex = Example("What is the secret?", "1")
    secret = "rl" + secrets.token_hex(12)
    writer, reader, beside, holder = (env.reset(ex) for _ in range(4))
    (w,) = step(env, [writer], [cell(WRITER, secret, HOLD=0)])
    planted = {k for k, v in w["done"].items() if v is True}
    # channels a program can write (the sandbox per call makes them invisible to others, not impossible)
    assert {"tmp_file", "tmp_dir_000", "tmp_dir_555", "tmp_chmod", "pid_counter", "parent_nice"} <= planted
    # refused: the host's device nodes' times and the sandbox's own (the utime family), pid 1's memory (not dumpable)
    eperm, eacces = "error 1", "error 13"
    assert {w["done"][k] for k in w["done"] if k.startswith(("touch_", "utime_")) or k == "tmp_utime"} == {eperm}
    assert (w["done"]["pid1_memory"], w["done"]["parent_memory"]) == (eacces, eacces)
    (r,) = step(env, [reader], [cell(READER, secret, WAIT=0)])
    assert leaks(w, r) == {}
    # a member of the group running beside the writer, while the writer holds its processes and sockets open
    w2, r2 = step(env, [holder, beside], [cell(WRITER, secret, HOLD=4.0), cell(READER, secret, WAIT=2.0)])
    assert w2["held"][0] < r2["at"] < w2["held"][1]  # it read while the writer's processes were alive
    assert leaks(w2, r2) == {}
