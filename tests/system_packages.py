"""System (Debian) packages some tests need. Tests never install them: `.ci/run` installs them up front and
scripts/setup.sh (`make setup`) does when run as root. A test whose package is missing is skipped with the
install command; with RL_REQUIRE_CLUSTER_TESTS=1 (set by .ci/run) it fails instead, so that CI cannot pass
without running the rclone, shellcheck, bubblewrap and real-Slurm tests.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

REQUIRE_ENV = "RL_REQUIRE_CLUSTER_TESTS"


def skip_unless_required(reason: str) -> NoReturn:
    """Skip the test, or fail it when RL_REQUIRE_CLUSTER_TESTS=1."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1: this test must run, not be skipped]", pytrace=False)
    pytest.skip(reason)


def require_debian_packages(binaries: dict[str, str]) -> None:
    """binaries: command -> Debian package providing it. Skips the test (fails it when required) when one is
    missing, naming the packages to install."""
    missing = sorted({pkg for cmd, pkg in binaries.items() if shutil.which(cmd) is None})
    if missing:
        skip_unless_required(
            f"needs the Debian package(s) {', '.join(missing)}: sudo apt-get install -y {' '.join(missing)} "
            "(or make setup as root; .ci/run installs them)"
        )
