"""scripts/devcheck/ (the bounded device check, docs/gpu.md) on CPU (issue 41, item 6): the preflight row instead
of cascaded failures, the one vLLM line at startup, the stack rows with and without vLLM, the report without the
stale predicted failure, and nothing that names one GPU model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

DEVCHECK = REPO / "scripts" / "devcheck"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, DEVCHECK / f"{name}.py")
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def test_a_failed_preflight_is_one_row_and_the_stages_are_skipped(tmp_path):
    """CUDA asked for on a machine without it: before, every stage ran and failed on its own (minutes of
    cascaded FAIL rows); now the preflight row names the cause and the check ends at once."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "DEVCHECK_WORK": str(work), "PY": sys.executable}
    env.update(DEVCHECK_DEVICE="cuda", DEVCHECK_BUDGET_S="90", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        ["bash", str(DEVCHECK / "device_check.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    fails = [x for x in summary.splitlines() if "| FAIL |" in x]
    assert len(fails) == 1 and fails[0].startswith("| preflight | FAIL | CUDA was asked for but torch"), summary
    assert summary.startswith("verdict: FAIL (preflight)")
    stages = [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
    assert {s["rc"] for s in stages} == {-2} and not (work / "runs").exists()  # nothing ran
    log = (out / "devcheck.log").read_text()
    assert "preflight failed: stages 1-3 skipped" in log
    assert [x for x in log.splitlines() if "vllm: " in x and "[devcheck" in x]  # the one vLLM line, at startup
    assert "H100" not in log + summary + r.stdout


def test_the_vllm_line_names_a_site_version_other_than_the_pinned_one(tmp_path):
    pre = load("devcheck_preflight")  # the line is gpu_check's, which make gpu-check prints at its start too
    assert pre.pinned_vllm() == "0.32.0"
    assert pre.vllm_line("0.32.0", "0.32.0") == "vllm: 0.32.0 (the pinned version)"
    assert pre.vllm_line(None, "0.32.0").startswith("vllm: not installed: the HF-only path")
    # a site image's vLLM, as the preflight itself reads it
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.31.1'\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    r = subprocess.run(
        [sys.executable, str(DEVCHECK / "devcheck_preflight.py"), "--out", str(tmp_path / "o"), "--device", "cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert [x for x in r.stdout.splitlines() if x.startswith("vllm: ")] == [
        "vllm: site vLLM 0.31.1 is not the pinned 0.32.0 (requirements-gpu.txt): the vLLM rows test 0.31.1"
    ]


def test_stack_rows_with_and_without_vllm():
    pytest.importorskip("torch")
    cuda = load("devcheck_cuda")
    # vLLM installed: its import row is what it is (PASS with the version was reported as a WARN before)
    assert cuda.stack_result("vllm._C", "PASS", "imports", no_vllm=False) == ("PASS", "imports")
    assert cuda.stack_result("vllm._C", "FAIL", "imports", no_vllm=False) == ("FAIL", "imports")
    assert cuda.stack_result("Triton kernel", "FAIL", "compiles", no_vllm=False)[0] == "FAIL"
    # the HF-only path: vLLM's row SKIPs, a Triton failure is a warning
    assert cuda.stack_result("vllm._C", "SKIP", "imports", no_vllm=True) == ("SKIP", "imports (no vllm in this image)")
    assert cuda.stack_result("Triton kernel", "FAIL", "compiles", no_vllm=True) == (
        "WARN", "compiles (the HF-only path needs no Triton)",
    )  # fmt: skip


def test_the_report_has_no_predicted_failure(tmp_path):
    """Issue 29 T2 fixed the 2-rank timeout test on a 1-GPU box: its failure is a FAIL like any other now, not a
    'predicted failure' WARN; without vLLM the vLLM row SKIPs, with it its stage is a row."""
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (out / "stages.jsonl").write_text(json.dumps({"stage": "pytest", "rc": 1, "s": 9}) + "\n")
    (work / "logs" / "pytest.log").write_text(
        "FAILED tests/unit/runtime/test_gpu_guards.py::test_process_group_timeout_comes_from_the_config - x\n"
        "1 failed, 20 passed in 9s\n"
    )

    def report() -> dict[str, str]:
        subprocess.run(
            [sys.executable, str(DEVCHECK / "devcheck_report.py"), "--out", str(out), "--work", str(work)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        rows = [x.split(" | ") for x in (out / "summary.md").read_text().splitlines() if x.startswith("| ")]
        return {c[0].lstrip("| "): c[1] for c in rows if len(c) > 2}

    rows = report()
    assert rows["pytest subset on the CUDA machine"] == "FAIL"
    assert "predicted" not in (out / "summary.md").read_text()
    assert rows["vLLM rows (level-2 sleep + full reload, bf16 canary, several engines)"] == "SKIP"
    with open(out / "stages.jsonl", "a") as f:
        f.write(json.dumps({"stage": "vllm_rows", "rc": 0, "s": 120}) + "\n")
    (work / "logs" / "vllm_rows.log").write_text("4 passed, 1 skipped in 118s\n")
    assert report()["vLLM rows (level-2 sleep + full reload, bf16 canary, several engines)"] == "PASS"


def test_nothing_in_the_device_check_names_one_gpu_model():
    for path in [*DEVCHECK.iterdir(), REPO / "scripts" / "gpu_check.py"]:
        if path.suffix in (".py", ".sh"):
            assert "H100" not in path.read_text(), path
