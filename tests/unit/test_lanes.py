"""tests/lanes.py: two pytest runs share a tier a module at a time. Real pytest runs over a folder of small test
modules that record which run ran each test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

MODULE = """import os, time
import pytest
pytestmark = [{marks}]
def test_a({fixture}):
    time.sleep(0.3)
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(os.environ.get("RL_TEST_LANE", "main") + " " + __name__ + " a\\n")
def test_b():
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(os.environ.get("RL_TEST_LANE", "main") + " " + __name__ + " b\\n")
"""
CONFTEST = "import pytest\n@pytest.fixture(scope='session')\ndef server():\n    return 1\n"


def make_suite(tmp_path, first=()):
    """Five modules; test_m3 needs the session's `server` (main lane only); those in `first` are side_lane_first."""
    d = tmp_path / "suite"
    d.mkdir()
    (d / "conftest.py").write_text(CONFTEST)
    for k in range(5):
        marks = "pytest.mark.side_lane_first" if k in first else ""
        (d / f"test_m{k}.py").write_text(MODULE.format(fixture="server" if k == 3 else "", marks=marks))
    return d


@pytest.fixture
def suite(tmp_path):
    return make_suite(tmp_path)


def start(suite, tmp_path, lane=None, claims=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAN_LOG": str(tmp_path / "ran.log")}
    for var in ("RL_TEST_CLAIMS", "RL_TEST_LANE", "PYTEST_ADDOPTS"):  # the suite's own lanes and options
        env.pop(var, None)
    if claims:
        (tmp_path / "claims").mkdir(exist_ok=True)
        env["RL_TEST_CLAIMS"] = str(tmp_path / "claims")
    if lane:
        env["RL_TEST_LANE"] = lane
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.lanes", str(suite)]
    return subprocess.Popen(cmd, cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def ran(tmp_path) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in (tmp_path / "ran.log").read_text().splitlines()]


def test_side_lane_walks_from_the_last_module_and_leaves_the_servers_to_the_main_lane(suite, tmp_path):
    out = finish(start(suite, tmp_path, lane="side"))
    assert "the side lane ran 4 modules, left 1 to the other lane" in out
    # the modules from the last, each one's tests in order; test_m3 (needs `server`) left alone
    assert ran(tmp_path) == [("side", f"test_m{k}", t) for k in (4, 2, 1, 0) for t in "ab"]
    out = finish(start(suite, tmp_path))  # then the main lane: only what is left
    assert "the main lane ran 1 modules, left 4 to the other lane" in out
    assert ran(tmp_path)[8:] == [("main", "test_m3", "a"), ("main", "test_m3", "b")]


def test_side_lane_takes_the_modules_marked_side_lane_first_first(tmp_path):
    out = finish(start(make_suite(tmp_path, first=(1,)), tmp_path, lane="side"))
    assert "the side lane ran 4 modules, left 1 to the other lane" in out
    assert [m for _, m, t in ran(tmp_path) if t == "a"] == ["test_m1", "test_m4", "test_m2", "test_m0"]


def test_two_lanes_at_once_run_every_test_exactly_once(suite, tmp_path):
    main, side = start(suite, tmp_path), start(suite, tmp_path, lane="side")
    finish(main), finish(side)
    got = ran(tmp_path)
    assert sorted((m, t) for _, m, t in got) == sorted((f"test_m{k}", t) for k in range(5) for t in "ab")
    lane_of = {m: lane for lane, m, _ in got}
    assert all(lane_of[m] == lane for lane, m, _ in got)  # a module's tests all in one lane
    assert lane_of["test_m3"] == "main"
    assert len(os.listdir(tmp_path / "claims")) == 5


def test_without_a_claims_directory_the_plugin_does_nothing(suite, tmp_path):
    out = finish(start(suite, tmp_path, lane="side", claims=False))
    assert "10 passed" in out and "lanes:" not in out
    assert [m for _, m, _ in ran(tmp_path)] == [f"test_m{k}" for k in range(5) for _ in "ab"]  # in order
