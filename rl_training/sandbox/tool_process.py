"""The sandbox's unconfined tier: a ToolEnvironment's tools (trusted code, a task's own) in a child process of their
own, so a tool that runs past its time limit is stopped from outside and counted. The confined tier, for code a
model wrote, is the pool (pool.py); both frame their messages and walk /proc with worker.py's functions.

In the trainer's own process a time limit is SIGALRM in the main thread, which a tool that catches Exception
(or BaseException) swallows, running on unseen; in any other thread it is a daemon thread abandoned while it
still runs. Here each call is one request to a fresh interpreter (`subprocess`, never fork: the trainer holds
CUDA and vLLM threads); a call past `timeout_s` SIGKILLs the child's process group and every process below it
that left the group (`setsid`), reaps the child and is answered as a timeout; the next call gets a new process.

    tp = ToolProcess([calculator], timeout_s=5.0)
    tp.start()                                         # ValueError (one line) if the child cannot import a tool
    text, err = tp.call("calculator", {"a": 1, "b": 2})  # ("3", "")
    tp.close()

The wire: a socketpair, each message one frame of worker.py's (a 4-byte length, then the bytes) holding a pickle
(arguments may hold ints past Python's 4300-digit str limit, which JSON cannot carry). The child renders a return
value to text itself, so only plain strings come back, read with an unpickler that loads no class. The child's
stdout and stderr are the parent's stderr (a tool may print). A tool is imported in the child by reference
(`__module__` + `__qualname__`; a user's task file from its path under the name config.plugins.import_file gave
it), so it must be defined at module level; its module-level state lives as long as its process (until a timeout
or crash replaces it).

The child runs tool_worker.py. What it cannot stop: a process that double-forked out of the tree and its group
before the timeout (only a pid namespace stops that: the confined tier, pool.py).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rl_training.base.errors import one_line
from rl_training.sandbox.worker import ChannelClosed, FrameTooBig, descendants, recv_frame, send_frame

MAX_REPLY_BYTES = 16 << 20  # a reply over this is refused unread (a crash): the result is cut to tokens anyway
REAP_S = 5.0  # the longest a kill waits for the processes below the child to end (SIGKILL takes microseconds)
START_TIMEOUT_S = 60.0  # spawn to "ready": a fresh interpreter importing the tools' modules (torch takes seconds)
# The child's first statement puts the parent's sys.path in place, so it imports what the parent imports
# (rl_training, a test's tests.* modules) whatever its working directory or install.
_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from rl_training.sandbox.tool_worker import main; main(int(sys.argv[2]), int(sys.argv[3]))"
)


# -------------------------------------------------------------------------------------------------- the wire
class ToolFailed(Exception):
    """Raised by a tool (or ToolEnvironment.invoke) for a failure whose `text` is the whole result, counted under
    `cls` (one of the environment's error_classes). The child answers it with its text and class."""

    def __init__(self, cls: str, text: str):
        super().__init__(text)
        self.cls, self.text = cls, text


class _PlainUnpickler(pickle.Unpickler):
    """The child's replies are tuples of strings: nothing that names a class or function is loaded."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a tool process's reply may hold only plain values, not {module}.{name}")


def _plain_message(data: bytes) -> tuple[str, ...]:
    """The child's message; UnpicklingError, its text one line, for anything else in the channel."""
    try:
        msg = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 -- bytes a tool wrote into the channel can make pickle raise anything
        raise pickle.UnpicklingError(one_line(e)) from None
    if not isinstance(msg, tuple) or not msg or not all(type(x) is str for x in msg):
        raise pickle.UnpicklingError(f"a tool process's reply must be a tuple of strings, got {type(msg).__name__}")
    return msg


# ---------------------------------------------------------------------------------------- tool references
def tool_reference(fn: Callable) -> tuple[str, str, str, str]:
    """(name, module, qualname, file) the child imports `fn` by; ValueError (one line) when it cannot be: a
    lambda, a function defined inside another, an object without a module-level name that leads back to it."""
    label = getattr(fn, "__name__", None)
    label = label if isinstance(label, str) else type(fn).__name__
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise ValueError(
            f"tool {label!r} is not importable by reference (a lambda or a function defined inside another): "
            "define it at module level"
        )
    mod = sys.modules.get(module)
    found: Any = mod
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if mod is None or found is not fn:
        raise ValueError(
            f"tool {label!r} is not importable by reference: {module}.{qualname} does not name it (redefined, or "
            "wrapped without functools.wraps): define it at module level"
        )
    file = getattr(mod, "__file__", None) or ""
    if module == "__main__" and not file:
        raise ValueError(f"tool {label!r} is defined in a __main__ without a file: define it in a module")
    return label, module, qualname, file


def _ended(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _exited(pid: int) -> bool:
    """Whether our child `pid` has ended, without reaping it: while it is a zombie its pid, which is also its
    process group's id, cannot be reused, so killing that group later cannot reach a stranger."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


# ------------------------------------------------------------------------------------------------ the class
class ToolProcess:
    """A ToolEnvironment's tools run in a child process of their own; a call past timeout_s kills that process
    (SIGKILL to its whole process group) and is answered as a timeout; the next call gets a fresh process.

    One call at a time (a lock), from any thread; no signal is used in this process. `respawn_early` starts the
    replacement as soon as a process is killed or crashed (its interpreter boots while the caller goes on; the
    next call waits for its "ready"); False starts it on the next call. Counters: `spawns` (processes started),
    `kills` (killed for a timeout)."""

    def __init__(
        self,
        tools: Sequence[Callable],
        timeout_s: float,
        *,
        start_timeout_s: float = START_TIMEOUT_S,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        respawn_early: bool = True,
    ):
        if not timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"timeout_s and start_timeout_s must be > 0, got {timeout_s}, {start_timeout_s}")
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.max_reply_bytes, self.respawn_early = int(max_reply_bytes), bool(respawn_early)
        self.refs = [tool_reference(fn) for fn in tools]
        names = [r[0] for r in self.refs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"two tools are named {dup[0]!r}")
        self.names = frozenset(names)
        self.spawns = self.kills = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lifeline: Any = None  # our end of the pipe whose EOF tells the child we are gone
        self._ready = False
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The current child's pid (None when there is none)."""
        return self._proc.pid if self._proc is not None else None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn the child and wait until it has imported every tool; ValueError (one line) when it cannot."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolProcess.start after close()")
            problem = self._ensure_ready()
            if problem:
                raise ValueError(f"the tools' process could not start: {problem}")

    def close(self) -> None:
        """Kill and reap the child (its whole tree); idempotent. It waits for a call in progress (at most
        timeout_s); later calls raise RuntimeError."""
        with self._lock:
            self._closed = True
            if self._proc is not None:
                self._end()

    def __enter__(self) -> ToolProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        life_r, life_w = os.pipe()
        path = json.dumps([p for p in sys.path if isinstance(p, str)])
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", "-c", _BOOT, path, str(theirs.fileno()), str(life_r)],
                pass_fds=(theirs.fileno(), life_r),
                stdin=subprocess.DEVNULL,
                stdout=2,  # the protocol is the socket; what a tool prints goes to our stderr
                stderr=2,
                start_new_session=True,  # its own process group: one killpg reaches whatever it started
            )
        except BaseException:
            ours.close()
            os.close(life_w)
            raise
        finally:
            theirs.close()
            os.close(life_r)
        self.spawns += 1
        self._sock, self._lifeline, self._ready = ours, os.fdopen(life_w, "wb", buffering=0), False
        send_frame(ours, pickle.dumps({"tools": self.refs}), time.monotonic() + self.start_timeout_s)

    def _ensure_ready(self) -> str:
        """A ready child ('' ) or why there is none (the child is then gone)."""
        if self._proc is not None and _exited(self._proc.pid):  # it died between calls (a tool's thread)
            self._end()
        if self._proc is None:
            try:
                self._spawn()
            except OSError as e:
                if self._proc is not None:
                    self._end()
                return f"cannot start {sys.executable}: {one_line(e)}"
        if self._ready:
            return ""
        deadline = time.monotonic() + self.start_timeout_s
        try:
            msg = _plain_message(recv_frame(self._sock, self.max_reply_bytes, deadline))
        except TimeoutError:
            problem = f"it was not ready within {self.start_timeout_s:g} s"
        except (ChannelClosed, OSError):
            problem = f"it ended while importing the tools ({_ended(self._end(grace_s=5.0))})"
        except FrameTooBig as e:
            problem = f"its first message of {e.n} bytes is over the {self.max_reply_bytes} byte limit"
        except pickle.UnpicklingError as e:
            problem = f"its first message could not be read ({e})"
        else:
            self._ready = msg[0] == "ready"
            problem = "" if self._ready else (msg[1] if len(msg) > 1 else str(msg))
        if problem and self._proc is not None:
            self._end()
        return problem

    def _end(self, grace_s: float = 0.0) -> int:
        """Kill the child's tree, reap the child, drop our ends; the child's exit code (negative: its signal).
        With grace_s, a child that closed its socket may first end by itself (its own exit status is reported)."""
        proc = self._proc
        assert proc is not None
        end = time.monotonic() + grace_s
        while not _exited(proc.pid) and time.monotonic() < end:
            time.sleep(0.005)
        kill_tree(proc.pid)  # also when it ended by itself: what it started may still run in its group
        code = proc.wait()
        self._sock.close()
        self._lifeline.close()
        self._proc, self._sock, self._lifeline, self._ready = None, None, None, False
        return code

    def _replace(self, grace_s: float = 0.0) -> int:
        code = self._end(grace_s)
        if self.respawn_early and not self._closed:
            try:
                self._spawn()
            except OSError:  # the next call tries again and answers why it cannot
                if self._proc is not None:
                    self._end()
        return code

    # ------------------------------------------------------------------------------------------------ calls
    def call(self, name: str, arguments: dict) -> tuple[str, str]:
        """(result text, error class or ''): the tool's rendered return value, or an `error: ...` text under
        'raised', 'timeout', 'crash', 'arguments' (not sendable) or the class a ToolFailed names."""
        if name not in self.names:
            raise KeyError(f"no tool named {name!r} (tools: {', '.join(sorted(self.names))})")
        try:
            request = pickle.dumps((name, arguments), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 -- pickling raises TypeError, PicklingError, RecursionError, ...
            return f"error: {name}: its arguments cannot be sent to its process ({one_line(e)})", "arguments"
        with self._lock:
            if self._closed:
                raise RuntimeError("ToolProcess.call after close()")
            problem = self._ensure_ready()
            if problem:
                return f"error: {name} crashed: its process could not start ({problem})", "crash"
            return self._exchange(name, request)

    def _exchange(self, name: str, request: bytes) -> tuple[str, str]:
        crashed = f"error: {name} crashed:"
        deadline = time.monotonic() + self.timeout_s  # from here: the tool's own time, not its process's start
        try:
            send_frame(self._sock, request, deadline)
            msg = _plain_message(recv_frame(self._sock, self.max_reply_bytes, deadline))
        except TimeoutError:
            self.kills += 1
            self._replace()
            return f"error: {name} timed out after {self.timeout_s:g} s", "timeout"
        except (ChannelClosed, OSError):  # after TimeoutError, an OSError too: the socket broke
            code = self._replace(grace_s=1.0)
            return f"{crashed} its process ended without a reply ({_ended(code)})", "crash"
        except FrameTooBig as e:
            self._replace()
            return f"{crashed} its reply of {e.n} bytes is over the {self.max_reply_bytes} byte limit", "crash"
        except pickle.UnpicklingError as e:  # its text is one line (_plain_message)
            self._replace()
            return f"{crashed} its reply could not be read ({e})", "crash"
        if msg[0] != "reply" or len(msg) != 3:
            self._replace()
            return f"{crashed} its reply could not be read (a {msg[0]!r} message)", "crash"
        return msg[1], msg[2]


# ------------------------------------------------------------------------------------------------- killing
def kill_tree(pid: int) -> None:
    """SIGKILL to the process group `pid` leads and to every process below it, in the group or not (setsid); then
    wait (up to REAP_S) until each but `pid` (its parent reaps it) has ended. The group is stopped first, so it
    forks nothing new while /proc is read; the others are held by pidfds, which cannot reach a process that
    reused a pid in between and poll readable when theirs ends (a grandchild cannot be wait()ed)."""
    try:
        os.killpg(pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    handles = []
    for p in descendants(pid, group=True):
        try:
            handles.append(os.pidfd_open(p))
        except OSError:  # ended since the listing
            continue
    try:
        os.killpg(pid, signal.SIGKILL)
        for fd in handles:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_ended(handles, REAP_S)
    finally:
        for fd in handles:
            os.close(fd)


def _wait_ended(pidfds: list[int], timeout_s: float) -> None:
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    pending, end = set(pidfds), time.monotonic() + timeout_s
    while pending and (left := end - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            pending.discard(fd)
            poller.unregister(fd)
