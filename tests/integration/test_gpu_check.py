"""scripts/gpu_check.py on CPU: the verdict table and its exit status, the canary and sleep-memory rules, and
the whole script on a CPU machine (CUDA rows SKIP, exit 0) and on a GPU node with a CPU torch (FAIL, exit 1)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import H100, REPO, fake_nvidia_smi, needs_cpu_torch

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gc = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(spec))  # dataclasses look it up there
spec.loader.exec_module(gc)


def test_table_and_exit_status():
    rows = [gc.Row("platform", gc.PASS, "gpu", "CUDA works"), gc.Row("GPUs", gc.SKIP, "(no GPU)", ">= 1")]
    rows.append(gc.Row("weights synced every step", gc.WARN, "no updates", "updates > 0"))
    assert gc.exit_status(rows) == 0  # SKIP and WARN never fail the verdict
    text = gc.render(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["check", "result", "value", "expected"]
    assert lines[-1] == "verdict: PASS  [1 PASS, 0 FAIL, 1 WARN, 1 SKIP]"
    col = lines[0].index("result")  # aligned columns: every row's result starts under the header's
    assert [line[col : col + 4] for line in lines[2:5]] == ["PASS", "SKIP", "WARN"]
    rows.append(gc.Row("vllm._C", gc.FAIL, "ImportError", "imports"))
    rows.append(gc.Row("NCCL all-reduce, 2 GPUs", gc.FAIL, "sums []", "sum 3.0"))
    assert gc.exit_status(rows) == 1
    assert gc.render(rows).splitlines()[-1].startswith("verdict: FAIL (vllm._C, NCCL all-reduce, 2 GPUs)")


def test_bounds_canary_and_sleep_rules():
    assert gc.bound_row("c", 0.005, 0.02).result == gc.PASS
    assert gc.bound_row("c", 0.3, 0.02).result == gc.FAIL  # stale engine weights at lr 1e-2
    assert gc.bound_row("c", None, 0.02).value == "missing" and gc.bound_row("c", float("nan"), 1).result == gc.FAIL
    assert gc.bound_row("freed", 20.0, 16.0, below=False, unit=" GiB").result == gc.PASS
    assert gc.bound_row("freed", 0.01, 16.0, below=False, unit=" GiB").expected == "> 16 GiB"

    def step(n, diff=0.004, version=None, grad=0.5):
        return {
            "step": n,
            "rollout/logp_diff_mean": diff,
            "rollout/weight_version": version or n + 1,
            "train/grad_norm": grad,
        }

    good = [step(n) for n in range(1, 5)]
    assert [r.result for r in gc.canary_rows(good, "bfloat16")] == [gc.PASS, gc.PASS]
    stale = [*good[:3], step(4, diff=0.4)]  # the worst step decides
    assert gc.canary_rows(stale, "bfloat16")[0].result == gc.FAIL
    assert gc.canary_rows(good, "float32")[0].result == gc.FAIL  # float32's bound is 1e-3
    assert gc.canary_rows([step(1), step(2, version=2)], "bfloat16")[1].result == gc.FAIL  # a sync was skipped
    assert gc.canary_rows([step(n, grad=0.0) for n in (1, 2)], "bfloat16")[1].result == gc.WARN  # nothing trained
    assert [r.result for r in gc.sleep_rows(good, cuda=False)] == [gc.SKIP, gc.SKIP]


@needs_cpu_torch
def test_cpu_machine_skips_cuda_rows_and_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert gc.main(["--skip-tests"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "gpu-check: vllm: 0.32.0 (the pinned version)"  # the one vLLM line, first
    table = out[out.index("check ") :].splitlines()
    skipped = [line.split("  ")[0].strip() for line in table if " SKIP " in line]
    assert len(skipped) == 13 and "vLLM sleep frees memory" in skipped and "NCCL all-reduce, 2 GPUs" in skipped
    assert all("(no GPU)" in line for line in table if " SKIP " in line)
    assert table[-1] == "verdict: PASS  [1 PASS, 0 FAIL, 0 WARN, 13 SKIP]"


@needs_cpu_torch
def test_gpu_node_with_cpu_torch_fails(tmp_path, monkeypatch, capsys):
    fake_nvidia_smi(tmp_path / "bin", [H100])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # no stamp: a venv of unknown origin
    assert gc.main([]) == 1
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[2].startswith("platform") and " FAIL " in table[2] and "is a CPU build" in table[2]
    assert "(CUDA unusable: see platform)" in table[3]
    assert table[-1].startswith("verdict: FAIL (platform)")


def test_triton_kernel_check_runs_in_tritons_interpreter():
    """The kernel of the 'Triton kernel' row, run by Triton's CPU interpreter (on a GPU it is compiled)."""
    code = "import gpu_check; print(gpu_check.check_triton('cpu'))"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO / 'scripts'}{os.pathsep}{REPO}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("triton ")


def test_a_raising_check_is_a_fail_row():
    def broken():
        raise ImportError("libcudart.so.13: cannot open shared object file\nmore lines")

    row = gc.guarded("vllm._C", broken, "imports")
    assert (row.result, row.value) == (gc.FAIL, "ImportError: libcudart.so.13: cannot open shared object file")


def test_help_names_the_make_target(capsys):
    with pytest.raises(SystemExit):
        gc.main(["--help"])
    assert "make gpu-check" in capsys.readouterr().out


@pytest.mark.slow
@needs_cpu_torch
def test_rl_rows_run_for_real_on_cpu(tmp_path, capsys):
    """The RL rows end to end with --run-on-cpu (float32, the CPU vLLM, 4 steps + resume to 6): the same
    subprocesses and metric reads a GPU machine runs; the sleep rows stay SKIP (no sleep mode on CPU)."""
    assert gc.main(["--run-on-cpu", "--skip-tests", "--keep", str(tmp_path)]) == 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    result = {line.split("  ")[0]: line for line in table[2:-2]}
    for check in ("RL steps (float32, CPU)", "canary logp_diff_mean (float32)", "checkpoint + resume"):
        assert " PASS " in result[check], result[check]
    assert "versions [2.0, 3.0, 4.0, 5.0]" in result["weights synced every step"]  # build + one sync per step
    assert " SKIP " in result["vLLM sleep frees memory"]
    assert "  enforce_eager: true\n" in (tmp_path / "check" / "config.yaml").read_text()  # CUDA graphs only on a GPU


def hide_vllm(tmp_path) -> dict:
    """An environment whose `import vllm` fails, for this process's children too: a stub package first on
    PYTHONPATH that raises ImportError, as on an image without vLLM."""
    stub = tmp_path / "no_vllm" / "vllm"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named vllm (hidden by the test)')\n")
    return {**os.environ, "PYTHONPATH": f"{stub.parent}{os.pathsep}{REPO}"}


def test_vllm_missing_is_found_and_its_rows_skip(tmp_path):
    code = "import gpu_check as g; r = g.vllm_missing(); print(r); print(g.gpu_tests_row(True, False, '', r).result)"
    env = hide_vllm(tmp_path)
    env["PYTHONPATH"] += f"{os.pathsep}{REPO / 'scripts'}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    reason, row = out.stdout.strip().splitlines()
    assert reason.startswith("(vLLM not installed: the RL rows use the HF backend; ImportError: No module named vllm")
    assert row == gc.SKIP  # the gpu-marked tests need vLLM: SKIP, never FAIL
    assert gc.vllm_missing() == ""  # here vLLM is installed


@pytest.mark.slow
@needs_cpu_torch
def test_without_vllm_the_rl_rows_run_on_hf_and_nothing_fails(tmp_path):
    """Issue 29 item 2: no vLLM (hidden from the script and every process it starts): nothing is installed, the RL
    rows run on the HF backend for real (4 steps + resume to 6), what needs vLLM says SKIP with the reason, and
    the verdict is PASS."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--run-on-cpu", "--keep", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=1200, env={**hide_vllm(tmp_path), "PATH": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("\n\n")[-1].splitlines()
    result = {line.split("  ")[0]: line for line in table[2:-2]}
    for check in ("RL steps (float32, HF backend, CPU)", "canary logp_diff_mean (float32)", "checkpoint + resume"):
        assert " PASS " in result[check], result[check]
    for check in ("weights synced every step", "vLLM sleep frees memory", "vLLM wake restores KV cache"):
        assert " SKIP " in result[check] and "vLLM not installed" in result[check], result[check]
    assert table[-1].startswith("verdict: PASS") and " FAIL" not in "\n".join(table[2:-2])
    assert "  backend: hf\n" in (tmp_path / "w" / "check" / "config.yaml").read_text()  # the run's rollout backend


def test_every_run_a_test_starts_stays_on_the_cpu_unless_it_is_a_gpu_test(tmp_path):
    """Issue 50, item 6: tests/conftest.py sets RL_DEVICE=cpu for the whole session, so every launch from a test
    (torchrun, a script, a plain subprocess) keeps its runs on the CPU, also on a GPU machine; the gpu-marked tests of
    test_gpu.py take the GPU back explicitly, for themselves and for the torchrun workers they start."""
    import ast

    from rl_training.base import dist

    assert os.environ[dist.DEVICE_ENV] == "cpu"
    code = f"import os; print(os.environ.get({dist.DEVICE_ENV!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "cpu"  # a launch that names nothing inherits it
    tree = ast.parse((REPO / "tests" / "integration" / "test_gpu.py").read_text())
    (fixture,) = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_on_the_gpu"]
    assert "pytest.fixture(autouse=True)" in ast.unparse(fixture.decorator_list[0])
    assert "monkeypatch.delenv(dist.DEVICE_ENV, raising=False)" in ast.unparse(fixture)
