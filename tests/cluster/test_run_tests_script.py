"""scripts/run_tests.sh, the lanes of `make test` and `make test-demos`, run with a stand-in for the venv's
python (PY=...) that records each pytest it is asked for: which tiers go to which lane, which run is pinned, the
stress tier's load, and that a failure in either lane is the script's exit status."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import REPO

FAKE_PY = r"""#!/usr/bin/env bash
# The affinity query (-c ...) answers $FAKE_LAST_CORE; a pytest run is logged with its load and affinity, and
# fails (exit 3) when its arguments contain $FAKE_FAIL.
if [ "$1" = -c ]; then echo "$FAKE_LAST_CORE"; exit 0; fi
echo "$* | burners=${RL_STRESS_BURNERS:-unset} | lane=${RL_TEST_LANE:-main} | claims=${RL_TEST_CLAIMS:-unset}\
 | threads=${RL_CPU_THREADS:-unset} | cpus=$(taskset -pc $$ | sed 's/.*: //')" >> "$FAKE_LOG"
if [ -n "${FAKE_FAIL:-}" ]; then case "$*" in *"$FAKE_FAIL"*) exit 3 ;; esac; fi
exit 0
"""


def run_lanes(tmp_path, last_core: str, fail: str = "", *args: str) -> tuple[int, dict[str, str]]:
    """The script's exit status and, per tier folder (the side lane's share of the integration tier as
    'tests/integration side'), the line its pytest logged."""
    py = tmp_path / "python"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    log = tmp_path / "log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PY": str(py), "FAKE_LOG": str(log), "FAKE_LAST_CORE": last_core, "FAKE_FAIL": fail}
    r = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    runs = {}
    for line in log.read_text().splitlines():
        tiers = " ".join(w for w in line.split(" | ")[0].split() if w.startswith("tests/"))
        runs[tiers + (" side" if "lane=side" in line else "")] = line
    return r.returncode, runs


def all_cpus() -> str:
    """This process's affinity as taskset prints it (the lanes' unpinned runs inherit it)."""
    out = subprocess.run(["taskset", "-pc", str(os.getpid())], capture_output=True, text=True).stdout
    return out.split(": ")[1].strip()


@pytest.fixture
def last_core() -> str:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("the two-lane layout needs two cores")
    return str(cores[-1])


def test_make_test_lanes(tmp_path, last_core):
    status, runs = run_lanes(tmp_path, last_core)
    assert status == 0
    assert set(runs) == {
        "tests/integration", "tests/unit", "tests/cluster", "tests/stress", "tests/real_model", "tests/integration side"
    }  # fmt: skip
    assert runs["tests/unit"].endswith(f"cpus={last_core}")  # the unit tier on the last core
    for tier in ("tests/integration", "tests/cluster", "tests/stress", "tests/real_model", "tests/integration side"):
        assert runs[tier].endswith(f"cpus={all_cpus()}"), runs[tier]
    assert "burners=0" in runs["tests/stress"]  # its load is the integration tier beside it
    assert "burners=unset" in runs["tests/integration"]
    # The integration tier in both lanes, sharing its modules through one claims directory (tests/lanes.py); the
    # side lane's share after its own tiers; one torch thread per process in every run.
    main, side = runs["tests/integration"], runs["tests/integration side"]
    claims = main.split("claims=")[1].split(" |")[0]
    assert claims != "unset" and f"claims={claims} " in side and "-p tests.lanes" in main and "-p tests.lanes" in side
    assert [k for k in runs if k != "tests/integration"] == ["tests/unit", "tests/cluster", "tests/stress",
                                                            "tests/real_model", "tests/integration side"]  # fmt: skip
    assert all("threads=1 " in line for line in runs.values())


TIERS = ["tests/integration", "tests/unit", "tests/cluster", "tests/stress", "tests/real_model"]


@pytest.mark.parametrize("fail", TIERS)
def test_a_failure_in_either_lane_fails_the_script_and_the_rest_still_runs(tmp_path, last_core, fail):
    status, runs = run_lanes(tmp_path, last_core, fail)
    assert status == 3
    assert len(runs) == 6  # a failed tier does not stop the tiers after it


def test_one_core_runs_every_tier_in_one_lane_and_stress_with_its_own_load(tmp_path):
    status, runs = run_lanes(tmp_path, "")
    assert status == 0
    assert set(runs) == {"tests/unit tests/integration tests/cluster tests/real_model", "tests/stress"}
    assert "burners=unset" in runs["tests/stress"]  # the test's default: two busy loops


def test_demo_lanes(tmp_path, last_core):
    status, _ = run_lanes(tmp_path, last_core, "", "demos")
    assert status == 0
    log = (tmp_path / "log").read_text().splitlines()  # both runs name tests/demos: told apart by their markers
    (side,) = [x for x in log if "-m one_core" in x]
    (main,) = [x for x in log if "-m not one_core" in x]
    assert len(log) == 2 and side.endswith(f"cpus={last_core}") and main.endswith(f"cpus={all_cpus()}")
