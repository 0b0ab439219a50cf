"""System (Debian) packages some tests need: installed on demand, non-interactively, a no-op when present.

CI (.ci/run) installs them up front; this covers `make test` on a fresh development machine. A test is
skipped, with the reason, only when a package is missing and cannot be installed (not root, no apt-get);
with RL_REQUIRE_CLUSTER_TESTS=1 (set by .ci/run) it fails instead, so that CI cannot pass without running
the rclone, shellcheck and real-Slurm tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import NoReturn

import pytest

REQUIRE_ENV = "RL_REQUIRE_CLUSTER_TESTS"


def skip_unless_required(reason: str) -> NoReturn:
    """Skip the test, or fail it when RL_REQUIRE_CLUSTER_TESTS=1."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1: this test must run, not be skipped]", pytrace=False)
    pytest.skip(reason)


def require_debian_packages(binaries: dict[str, str]) -> None:
    """binaries: command -> Debian package providing it. Installs the missing packages or skips the test."""
    missing = sorted({pkg for cmd, pkg in binaries.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        skip_unless_required(
            f"needs the Debian package(s) {', '.join(missing)} (install them as root: apt-get install)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or any(shutil.which(c) is None for c in binaries):
        skip_unless_required(f"could not install {', '.join(missing)}: {r.stderr.strip()[-300:]}")
