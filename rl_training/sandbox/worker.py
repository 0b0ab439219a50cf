"""The sandbox side: a template process that forks one fresh candidate per program, the value codec, and what every
process this package runs shares with the side that drives it: the message framing and the /proc walk.

This file runs inside the bubblewrap sandbox as `python -I -S -c <this source> <ctl_fd> <mode> <preload|lean>`
(standard library only, no site-packages; lean: no common modules imported ahead, for a sandbox that serves one
program) and is also imported by the trusted side for `encode`/`decode`, the framing and `descendants`, so both
ends share one protocol: the pool's jobs (handle.py) and the tools' process (tool_process.py, tool_worker.py)
frame their messages with send_frame/recv_frame, and the tools' kill (tool_process.kill_tree) walks /proc with
descendants, as the template does. Nothing here decides a verdict: the candidate can only send back plain values,
which the trusted side (tasks/code/harness.py) decodes into builtin types and judges.

Protocol
- control (SOCK_SEQPACKET, trusted <-> template): {"op": "run", "limits": {...}} with one fd (the job
  socket) -> the template forks a candidate on it (no answer); {"op": "reap", "empty": bool}
  -> it kills every other process of the sandbox, reaps them, empties /tmp and /dev/shm unless "empty" is false
  (a sandbox closed after one job) and answers {"op": "reaped", "status": <wait status of the candidate or
  null>} (a classification hint only, never a verdict).
- job (SOCK_STREAM, trusted <-> candidate, a frame: 4-byte big-endian length + UTF-8 JSON): first {"code", "name",
  "setup"} -> {"ok": true} or {"error": class, "detail"}; then {"call": fn, "args", "kwargs"} ->
  {"value": v} | {"raise": type name} | {"unencodable": type name}, or {"stdin": text} -> {"stdout": text,
  "raise": type name or null}.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

MAX_DEPTH = 64  # nesting of encoded values; deeper is unencodable (and undecodable on the trusted side)
_HDR = struct.Struct(">I")


class ProtocolError(Exception):
    """A malformed, oversized or truncated message."""


# ------------------------------------------------------------------------------------------------ codec
def encode(x, depth=0):
    """A plain-JSON form of a value built from builtin types; tags keep tuple/set/dict/bytes/complex/inf
    distinct from lists and strings. Raises TypeError for anything else (a function, a custom object).
    Number subclasses are converted to the plain number: whatever they override, the trusted side only
    ever sees an int or a float."""
    if depth > MAX_DEPTH:
        raise TypeError("nested too deep")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x
    if t is float:
        return x if x == x and x not in (float("inf"), float("-inf")) else {"$f": repr(x)}
    if t is bytes:
        return {"$b": x.decode("latin-1")}
    if t is complex:
        return {"$c": [encode(x.real, depth + 1), encode(x.imag, depth + 1)]}
    # Containers and number subclasses (Counter, defaultdict, numpy scalars) are converted to the plain
    # builtin form: whatever they override, only plain values cross to the trusted side.
    if isinstance(x, dict):
        return {"$d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    if isinstance(x, list):
        return [encode(v, depth + 1) for v in x]
    if isinstance(x, tuple):
        return {"$t": [encode(v, depth + 1) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {"$fs" if isinstance(x, frozenset) else "$s": [encode(v, depth + 1) for v in x]}
    if isinstance(x, str):
        return str.__str__(x)
    import numbers

    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return encode(float(x), depth)
    raise TypeError(type(x).__name__)


_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def decode(x, depth=0):
    """The value `encode` described, built from builtin types only; ValueError/TypeError on anything else."""
    if depth > MAX_DEPTH + 1:
        raise ValueError("nested too deep")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [decode(v, depth + 1) for v in x]
    if t is not dict or len(x) != 1:
        raise ValueError("not an encoded value")
    ((tag, v),) = x.items()
    if tag == "$f" and v in _FLOATS:
        return _FLOATS[v]
    if tag == "$b" and type(v) is str:
        return v.encode("latin-1")
    if type(v) is not list:
        raise ValueError(f"bad tag {tag!r}")
    items = [decode(e, depth + 1) for e in v]
    if tag == "$t":
        return tuple(items)
    if tag == "$s":
        return set(items)  # TypeError for unhashable items: a malformed message
    if tag == "$fs":
        return frozenset(items)
    if tag == "$c" and len(items) == 2 and all(type(e) in (int, float) for e in items):
        return complex(*items)
    if tag == "$d" and all(type(e) is list and len(e) == 2 for e in items):
        return {k: val for k, val in items}
    raise ValueError(f"bad tag {tag!r}")


# ---------------------------------------------------------------------------------------------- framing
class ChannelClosed(ProtocolError):
    """The other end closed the socket before a whole message came."""

    def __init__(self):
        super().__init__("connection closed")


class FrameTooBig(ProtocolError):
    """A message over the reader's cap, refused before any of it is read: `n` bytes."""

    def __init__(self, n, cap):
        super().__init__(f"message of {n} bytes over the {cap}-byte cap")
        self.n = n


def _left(deadline):
    """Seconds until `deadline` (time.monotonic()), TimeoutError when none are left; None without one."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def send_frame(sock, data, deadline=None):
    """One message: its length (4 bytes, big-endian), then `data`. Past `deadline`, TimeoutError (the socket's
    own timeout is left as it is without one)."""
    if deadline is not None:
        sock.settimeout(_left(deadline))  # sendall's timeout bounds the whole send
    sock.sendall(_HDR.pack(len(data)) + data)


def recv_frame(sock, cap=None, deadline=None):
    """One message's bytes: FrameTooBig over `cap` (before any of it is read into memory), ChannelClosed when the
    other end closes first, TimeoutError past `deadline` (each read waits only for what is left of it)."""
    (n,) = _HDR.unpack(_recv_exact(sock, _HDR.size, deadline))
    if cap is not None and n > cap:
        raise FrameTooBig(n, cap)
    return _recv_exact(sock, n, deadline)


def _recv_exact(sock, n, deadline):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed
        got += k
    return bytes(buf)


def send_msg(sock, obj, deadline=None):
    """A JSON message in one frame."""
    send_frame(sock, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode(), deadline)


def recv_msg(sock, max_bytes, deadline=None):
    """One JSON message, refused (ProtocolError) over max_bytes before any of it is read into memory."""
    data = recv_frame(sock, max_bytes, deadline)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"bad message: {type(e).__name__}") from None


# ------------------------------------------------------------------------------------------ the candidate
def _set_limits(lim):
    import resource

    for name, soft, hard in (
        ("RLIMIT_CPU", lim["cpu_s"], lim["cpu_s"] + 1),
        ("RLIMIT_AS", lim["mem_bytes"], lim["mem_bytes"]),
        ("RLIMIT_NPROC", lim["nproc"], lim["nproc"]),
        ("RLIMIT_FSIZE", lim["fsize_bytes"], lim["fsize_bytes"]),
        ("RLIMIT_NOFILE", lim["nofile"], lim["nofile"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _error_class(e):
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, (SyntaxError, ValueError, OverflowError)) and not isinstance(e, UnicodeError):
        return "syntax"  # compile(): SyntaxError, null bytes (ValueError), too-large literals
    return "runtime_error"


def _run_stdio(code, name, stdin_text, out_cap):
    import io

    class _Capped(io.BytesIO):
        def write(self, b):
            if self.tell() + len(b) > out_cap:
                raise MemoryError("output cap")
            return super().write(b)

    out = io.TextIOWrapper(_Capped(), encoding="utf-8", errors="replace", write_through=True)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin_text.encode()), encoding="utf-8")
    sys.stdout, raised = out, None
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:  # a program's normal way to stop: exit(0)/sys.exit() count as ending
        raised = None if e.code in (None, 0) else "SystemExit"
    except BaseException as e:  # noqa: BLE001 -- the trusted side classifies; this only names the type
        raised = type(e).__name__
    finally:
        sys.stdout = sys.__stdout__
    out.flush()
    text = out.buffer.getvalue().decode("utf-8", "replace")
    return {"stdout": text, "raise": raised}


def candidate_main(fd, lim):
    """The forked candidate: limits, no inherited fds but the job socket, then serve the trusted side."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the template's SIG_DFL is for pid 1 only
    devnull = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    os.closerange(3, fd)
    os.closerange(fd + 1, 1 << 16)
    sock = socket.socket(fileno=fd)
    _set_limits(lim)
    max_in = lim["msg_bytes"]
    spec = recv_msg(sock, 1 << 24)
    ns = {"__name__": spec["name"], "__builtins__": __builtins__}
    try:
        code = compile(spec["setup"] + "\n" + spec["code"], "<candidate>", "exec")
        if spec["name"] != "__main__":
            exec(code, ns)
    except BaseException as e:  # noqa: BLE001 -- reported as a failure class, never a pass
        send_msg(sock, {"error": _error_class(e), "detail": type(e).__name__})
        os._exit(0)
    send_msg(sock, {"ok": True})
    while True:
        try:
            req = recv_msg(sock, max_in)
        except ProtocolError:
            os._exit(0)
        if "stdin" in req:
            send_msg(sock, _run_stdio(code, spec["name"], req["stdin"], lim["msg_bytes"] // 2))
            continue
        try:
            fn = ns[req["call"]]
            args, kwargs = decode(req["args"]), decode(req["kwargs"])
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- the type name goes back; the trusted side judges
            reply = {"raise": type(e).__name__ if isinstance(type(e).__name__, str) else "Exception"}
        else:
            try:
                reply = {"value": encode(result)}
            except (TypeError, RecursionError, ValueError) as e:
                reply = {"unencodable": str(e)[:200]}
        try:
            send_msg(sock, reply)
        except (TypeError, ValueError):
            send_msg(sock, {"unencodable": "not JSON"})


# ------------------------------------------------------------------------------------------- the template
def _kill_all(strict, watch=None):
    """SIGKILL every process of this sandbox but this one, until none is left, and reap them; the wait status of
    `watch` (a pid) if it was among them. In strict mode this template is the pid namespace's init (bwrap
    --as-pid-1), where kill(-1) reaches every other process of the sandbox and every orphan is reparented here;
    without one, the descendants are found through /proc (orphans come here: child subreaper)."""
    me, watched = os.getpid(), None
    while True:
        targets = [-1] if strict else descendants(me)
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, status = os.waitpid(-1, 0)  # one at a time, killing again in between: catches what forked meanwhile
        except ChildProcessError:
            return watched
        if pid == watch:
            watched = status


def _empty_dirs(roots):
    import shutil

    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def descendants(root, group=False):
    """Every process below `root` by /proc's parent links, whatever its group or session (a zombie until reaped
    too); with `group`, also every other member of the process group `root` leads (an orphan reparented away from
    it). [] without /proc. The one /proc walk of this package: the template's reap in weak mode and the tools'
    process kill (tool_process.kill_tree) both find what to kill with it."""
    children, members = {}, []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for p in entries:
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # ended since the listing
            continue
        ppid, pgrp = stat.rsplit(b")", 1)[1].split()[1:3]  # after the name, which may hold spaces or ')'
        children.setdefault(int(ppid), []).append(int(p))
        if group and int(pgrp) == root and int(p) != root:
            members.append(int(p))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return sorted(set(out + members))


PF_EXITING = 0x4  # the task has begun to exit (include/linux/sched.h), the flags field of /proc/<pid>/stat
EXIT_WAIT_S = 1.0


def _own_end(child):
    """The candidate's wait status if it has ended, or begun to end, on its own; else None. One killed by a
    signal (the filter's SIGSYS, SIGXCPU, its own kill) closes its job socket before it can be waited for, so the
    trusted side asks for the reap while it may still be exiting: read with WNOHANG then, its status was lost
    under load (1-17 in 1000 calls). It is waited for while it exits (PF_EXITING), up to EXIT_WAIT_S: a main
    thread that exits alone leaves the others running, and is then killed with the rest."""
    if child is None:
        return None
    deadline = time.monotonic() + EXIT_WAIT_S
    try:
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                return status
            with open(f"/proc/{child}/stat") as fh:
                flags = int(fh.read().rsplit(")", 1)[1].split()[6])
            if not flags & PF_EXITING or time.monotonic() > deadline:
                return None
            time.sleep(0.001)
    except (ChildProcessError, OSError, ValueError, IndexError):
        return None


def _not_ours(status):
    """A status _kill_all reaped, unless it is the SIGKILL the reap sends (a kernel SIGKILL reads the same)."""
    if status is None or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        return None
    return status


def template_main(ctl_fd, mode, preload=True):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_DUMPABLE 0: a candidate (same uid) cannot open our /proc/<pid>/mem, environ or maps (nor ptrace us,
    # which the filter refuses anyway). In strict mode we are the sandbox's pid 1, so no process inside is dumpable.
    libc.prctl(4, 0, 0, 0, 0)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphaned grandchildren come to us in weak mode too
    # As pid 1 of a namespace the kernel drops every signal from inside it that we have no handler for (SIGKILL and
    # SIGSTOP included); Python's one handler, SIGINT's KeyboardInterrupt, would let a program end the template.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    import builtins

    builtins.exit = builtins.quit = sys.exit  # what `site` (skipped: -S) would provide; programs call exit()
    common = "shutil resource io numbers math re collections itertools functools heapq bisect string typing"
    for mod in common.split() if preload else ():
        __import__(mod)  # imported once here, so each forked candidate starts with them loaded
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=ctl_fd)
    child = None
    while True:
        data, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 1)
        if not data:
            os._exit(0)  # the trusted side closed the pool
        msg = json.loads(data)
        if msg["op"] == "run":
            child = os.fork()
            if child == 0:
                ctl.close()
                try:
                    candidate_main(fds[0], msg["limits"])
                finally:
                    os._exit(0)
            os.close(fds[0])
        elif msg["op"] == "reap":
            status = _own_end(child)
            reaped = _kill_all(mode == "strict", watch=child)
            if status is None:  # it ended on its own between the look and the kill: its status, not the kill's
                status = _not_ours(reaped)
            if mode == "strict" and msg.get("empty", True):  # not when the sandbox is closed next (a fresh pool)
                _empty_dirs(("/tmp", "/dev/shm"))  # the next program starts with no file a previous one left
            ctl.send(json.dumps({"op": "reaped", "status": status}).encode())
            child = None
        elif msg["op"] == "ping":
            ctl.send(b'{"op":"pong"}')


if __name__ == "__main__":
    template_main(int(sys.argv[1]), sys.argv[2], sys.argv[3:4] != ["lean"])
