"""The cluster tier's fixture: the local Slurm cluster (scripts/slurm/local_cluster.sh, two slurmd on this host),
started once per session and stopped at the end if this session started it."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import SLURM_LOCAL, skip_unless_required


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        skip_unless_required(
            "the local Slurm cluster (slurmctld, 2 x slurmd, munge: scripts/slurm/local_cluster.sh) needs root"
        )
    r = subprocess.run(
        ["bash", str(SLURM_LOCAL), "start"],
        env={**os.environ, "SLURM_LOCAL_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 and "apt-get install failed" in r.stderr:
        skip_unless_required(f"could not install slurm-wlm/munge: {r.stderr.strip()[-500:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    started = "already running" not in r.stderr
    nodes = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True).stdout.split()
    if sum(int(n) for n in nodes) < 2:
        skip_unless_required("the running local Slurm cluster has fewer than 2 nodes (SLURM_LOCAL_NODES=1?)")
    yield
    if started:
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], capture_output=True, timeout=300)
