"""The trusted side's handles: on one sandbox (Worker: start it, send it control requests, kill it) and on one job in
it (Job: request and answer on the candidate's socket, under the job's deadline and message cap). worker.py is
what runs inside; confinement.py what it starts with; pool.py hands workers out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from rl_training.sandbox import seccomp_filter, worker
from rl_training.sandbox.confinement import (
    NOBODY,
    Confinement,
    PoolSettings,
    SandboxUnavailable,
    bwrap_argv,
    make_worker_cgroup,
    remove_worker_cgroup,
    start_failure,
    worker_argv,
)

REAP_S = 5.0  # a worker that takes longer to start a candidate or to kill and reap a job's processes is broken


class SandboxBroken(RuntimeError):
    """A worker stopped answering its control protocol (killed, stopped or crashed); it is replaced."""


class Worker:
    """One sandbox: a bwrap process whose template forks candidates; driven over a SOCK_SEQPACKET socket.

    Starting is two steps: the constructor starts bwrap (fast; the Pool does it on its spawner thread, see there),
    `wait_ready` waits for the template's answer (tens of ms: bwrap, the interpreter, its imports); with
    wait=False the caller does the second step, on any thread, so that several sandboxes start at once."""

    def __init__(
        self,
        settings: PoolSettings,
        python: str,
        confinement: Confinement = Confinement(),  # noqa: B008 -- frozen, so one default is safe
        wait: bool = True,
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
            raise SandboxUnavailable(start_failure(err, self.settings.mode == "strict")) from None

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


class JobTimeout(Exception):
    """The program's wall-clock deadline passed."""


class Job:
    """The trusted end of one candidate's socket: request/answer with the job's deadline and message cap.
    Raises JobTimeout past the deadline, worker.ProtocolError for an oversized, malformed or cut message."""

    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int):
        self.sock, self.deadline, self.max_bytes = sock, deadline, max_bytes

    def ask(self, msg: dict) -> dict:
        try:
            worker.send_msg(self.sock, msg, self.deadline)
            reply = worker.recv_msg(self.sock, self.max_bytes, self.deadline)
        except TimeoutError:
            raise JobTimeout from None
        except OSError as e:  # the candidate died or closed its end
            raise worker.ProtocolError(f"candidate gone: {type(e).__name__}") from None
        if not isinstance(reply, dict):
            raise worker.ProtocolError("reply is not an object")
        return reply
