"""Named fault points for the fault-injection tests (tests/integration/test_reliability_faults.py,
test_weight_guard.py).

`RL_FAULT_KILL=<point>@<n>[:<rank>]` SIGKILLs the process on the n-th time it reaches `point` (on that rank
only, when given). Unset, `point` is one dictionary lookup. The points sit in the windows a crash can hurt:
between a metrics line and the checkpoint that covers it, inside a checkpoint save, mid-way through a line.

`RL_FAULT_INJECT=<fault>@<n>[:<rank>]` makes `injected(fault)` true from the n-th visit on: the silent
failures a guard must catch (a weight sync that does nothing, a stale adapter, a server serving an older
version). Unset, the code path is the healthy one.
"""

from __future__ import annotations

import os
import signal

_visits: dict[str, int] = {}


def _armed(var: str = "RL_FAULT_KILL") -> tuple[str, int, int | None] | None:
    spec = os.environ.get(var)
    if not spec:
        return None
    where, _, rank = spec.partition(":")
    point, _, n = where.partition("@")
    return point, int(n or 1), int(rank) if rank else None


def due(point: str) -> bool:
    """True on the visit of `point` that RL_FAULT_KILL names (counts visits only while armed)."""
    armed = _armed()
    if armed is None or armed[0] != point:
        return False
    if armed[2] is not None and armed[2] != int(os.environ.get("RANK", 0)):
        return False
    _visits[point] = _visits.get(point, 0) + 1
    return _visits[point] == armed[1]


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def point(name: str) -> None:
    if due(name):
        kill()


_injected: dict[str, int] = {}


def injected(fault: str) -> bool:
    """True from the n-th visit of `fault` on, when RL_FAULT_INJECT names it (this rank's visits)."""
    armed = _armed("RL_FAULT_INJECT")
    if armed is None or armed[0] != fault:
        return False
    if armed[2] is not None and armed[2] != int(os.environ.get("RANK", 0)):
        return False
    _injected[fault] = _injected.get(fault, 0) + 1
    return _injected[fault] >= armed[1]
