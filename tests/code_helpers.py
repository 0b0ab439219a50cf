"""Shared by the code-sandbox tests: a pool fixture (bubblewrap installed on demand) and process accounting."""

from __future__ import annotations

import pytest

from rl_training.tasks.code.worker import descendants
from tests.system_packages import require_debian_packages


@pytest.fixture(scope="module")
def pool():
    require_debian_packages({"bwrap": "bubblewrap"})
    from rl_training.tasks.code.sandbox import Pool, PoolSettings

    p = Pool(PoolSettings(workers=2))
    yield p
    p.close()


def sandbox_processes(pool) -> dict[int, int]:
    """Worker bwrap pid -> number of processes below it. An idle strict worker has exactly 2: bwrap's
    pid-1 reaper inside the namespace and the template under it."""
    with pool._cv:
        workers = list(pool._idle)
    return {w.proc.pid: len(descendants(w.proc.pid)) for w in workers}
