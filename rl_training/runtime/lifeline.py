"""Workers die with their launcher: a torchrun worker whose agent (or SLURM launcher) is gone stops at once.

torch elastic (2.13: subprocess_handler.py, `start_new_session=True`) starts every worker in a session of
its own, so killing the agent, or its process group, leaves the workers training on: they keep appending to
metrics.jsonl and writing checkpoints while a resumed run writes there too. Two guards, set at worker start:

- PR_SET_PDEATHSIG(SIGKILL): the kernel kills the worker when the thread that forked it exits. torch's agent
  forks the workers from its main thread (LocalElasticAgent._start_workers), so that is the agent's death.
  Set after the fork, so a parent that died before the call is caught by comparing getppid() afterwards.
- A daemon thread polling getppid(): the fallback where pdeathsig does not fire (it tracks a *thread*, and
  a launcher that forked from a thread that lives on would never trigger it; non-Linux kernels lack it).

SIGKILL, not a clean exit: a clean exit would run `finally` blocks that log, checkpoint and wait for uploads,
i.e. write after the launcher's death. The last checkpoint is intact (atomic), so `ckpt.resume=latest`
continues the run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_pdeathsig() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc prctl (not Linux): the watchdog alone guards
        return False


def _watch(parent: int, poll_s: float) -> None:
    while True:
        if os.getppid() != parent:  # re-parented to init or a subreaper: the launcher is gone
            _die()
        time.sleep(poll_s)


def tie_to_launcher(poll_s: float = POLL_S) -> int | None:
    """Under torchrun: make this worker die with its parent (the agent). Returns the parent pid, or None when
    not launched by torchrun (a plain `python` run belongs to the user's shell and is left alone)."""
    if not launched_by_torchrun():
        return None
    parent = os.getppid()
    if parent == 1:  # the agent died while this worker was still importing
        _die()
    _set_pdeathsig()
    if os.getppid() != parent:  # it died between the two calls: pdeathsig was set too late to fire
        _die()
    threading.Thread(target=_watch, args=(parent, poll_s), name="lifeline", daemon=True).start()
    return parent
