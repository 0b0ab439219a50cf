"""CI's summary (.ci/run): tests/conftest.py records each pytest session's tiers, counts, exit status and time
($RL_TIERS) and every skip with its reason ($RL_SKIPS); scripts/ci_summary.py prints them with the learning margins
(tests/helpers.py clears, $RL_MARGINS). Real pytest runs of the suite's own modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, clears


def pytest_run(tmp_path, *args: str) -> int:
    env = {**os.environ, "RL_TIERS": str(tmp_path / "tiers.jsonl"), "RL_SKIPS": str(tmp_path / "skips.jsonl")}
    for var in ("RL_TEST_LANE", "RL_RECORDING_SESSION"):  # a session of its own, as CI's are
        env.pop(var, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300).returncode


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the gpu tests' skips, which run on a GPU machine")
def test_sessions_skips_and_margins_are_recorded_and_summarised(tmp_path, monkeypatch):
    assert pytest_run(tmp_path, "tests/integration/test_gpu.py") == 0  # its 5 tests skip on a CPU machine
    assert pytest_run(tmp_path, "tests/unit/test_readme.py", "-k", "no_such_test") == 5  # nothing selected
    first, second = (json.loads(x) for x in (tmp_path / "tiers.jsonl").read_text().splitlines())
    assert (first["tiers"], first["counts"], first["exit"], first["lane"]) == (["integration"], {"skipped": 5}, 0, "")
    assert (second["tiers"], second["counts"], second["exit"]) == (["(none collected)"], {}, 5)
    # a pytest that a recorded session starts (a test running pytest) records nothing of its own
    nested = {**os.environ, "RL_RECORDING_SESSION": "1", "RL_TIERS": str(tmp_path / "nested.jsonl")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_gpu.py"]
    assert subprocess.run(cmd, cwd=REPO, env=nested, capture_output=True, timeout=300).returncode == 0
    assert not (tmp_path / "nested.jsonl").exists()
    skips = [json.loads(x) for x in (tmp_path / "skips.jsonl").read_text().splitlines()]
    assert len(skips) == 5 and {s["reason"] for s in skips} == {"needs CUDA (no GPU on this machine)"}
    assert all(s["test"].startswith("tests/integration/test_gpu.py::") for s in skips)

    # margins as a demo records them: 0.2 past a bar of 0.3; an ablation 0.05 over its ceiling of 0.05
    monkeypatch.setenv("RL_MARGINS", str(tmp_path / "margins.jsonl"))
    assert clears("demo: gain", 0.5, 0.3) and not clears("demo: ablation (at most)", 0.1, 0.05, at_most=True)
    files = [str(tmp_path / f) for f in ("tiers.jsonl", "skips.jsonl", "margins.jsonl")]
    cmd = [sys.executable, "scripts/ci_summary.py", "--tiers", files[0], "--skips", files[1], files[2]]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    rows = {x.split("  ")[0]: x.split() for x in out.splitlines()}
    assert rows["integration"][1:5] == ["0", "0", "5", "0"]  # passed, failed, skipped, exit
    assert rows["(none collected)"][2:6] == ["0", "0", "0", "5"]
    assert rows["demo: gain"][-4:] == ["0.500", ">=", "0.3", "+0.200"]
    assert rows["demo: ablation (at most)"][-5:] == ["0.100", "<=", "0.05", "-0.050", "!"]  # below its bar: marked
    assert "5 skipped:" in out and "5 x needs CUDA (no GPU on this machine)" in out
