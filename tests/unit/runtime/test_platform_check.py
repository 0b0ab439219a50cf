"""The GPU-platform guard (rl_training/runtime/platform_check.py) with fake nvidia-smi binaries on PATH: a CPU torch,
an old driver or hidden GPUs on a GPU machine stop the runners with one line; a CPU machine runs as before."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rl_training.runners import sft_runner
from rl_training.runtime import platform_check as pc
from tests.helpers import H100, REPO, fake_nvidia_smi, needs_cpu_torch


@pytest.fixture
def gpu_node(tmp_path, monkeypatch):
    """PATH with a fake nvidia-smi listing two H100s on driver 570; a venv stamp that says cpu."""
    fake_nvidia_smi(tmp_path / "bin", [H100, H100])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".setup-stamp").write_text("cpu 0123abcd\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.delenv(pc.ALLOW_CPU_ENV, raising=False)
    return tmp_path


def platform(**kw) -> pc.Platform:
    base = dict(
        gpus_listed=8,
        driver="580.65.06",
        venv_platform="gpu",
        torch_version="2.13.0+cu130",
        torch_cuda="13.0",
        cuda_available=False,
        visible_devices=None,
    )
    return pc.Platform(**{**base, **kw})


def test_nvidia_smi_reads_gpu_count_and_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert pc.nvidia_smi() == (0, None)  # not installed: a CPU machine
    fake_nvidia_smi(tmp_path / "bin", [H100, H100, H100])
    assert pc.nvidia_smi() == (3, "570.86.15")
    fake_nvidia_smi(tmp_path / "bin", ["NVIDIA-SMI has failed because it couldn't communicate with the driver"], 9)
    assert pc.nvidia_smi() == (0, None)  # a failing nvidia-smi lists nothing


def test_cuda_problem_names_each_cause():
    assert pc.cuda_problem(platform(cuda_available=True)) is None  # working CUDA
    cpu = platform(gpus_listed=0, venv_platform="cpu", torch_version="2.13.0+cpu", torch_cuda=None)
    assert pc.cuda_problem(cpu) is None  # a CPU machine with a CPU venv: nothing to refuse
    msg = pc.cuda_problem(platform(venv_platform="cpu", torch_version="2.13.0+cpu", torch_cuda=None))
    assert "torch 2.13.0+cpu is a CPU build (this venv was set up for cpu)" in msg and "setup.sh gpu" in msg
    msg = pc.cuda_problem(platform(driver="570.86.15"))  # CUDA 13 wheels need R580
    assert "NVIDIA driver 570.86.15 is older than R580" in msg and "CUDA 13.0" in msg
    assert pc.cuda_problem(platform(driver="570.86.15", torch_cuda="12.8")) is not None
    assert "older than" not in pc.cuda_problem(platform(driver="570.86.15", torch_cuda="12.8"))  # R525 is enough
    assert "CUDA_VISIBLE_DEVICES=''" in pc.cuda_problem(platform(visible_devices=""))
    assert "no GPU is visible" in pc.cuda_problem(platform(gpus_listed=0, driver=None))  # gpu venv, GPU-less node
    assert "torch.cuda.init()" in pc.cuda_problem(platform())  # every known cause ruled out: how to find it
    for p in (platform(), platform(driver="570.1"), platform(torch_cuda=None)):
        assert "\n" not in pc.cuda_problem(p)  # one line


@needs_cpu_torch
def test_runner_refuses_a_cpu_torch_on_a_gpu_node(gpu_node, capsys):
    assert torch.version.cuda is None and not torch.cuda.is_available()  # this machine's CPU torch
    rc = sft_runner.main(["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), f"run.output_dir={gpu_node / 'runs'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: torch ") and "is a CPU build (this venv was set up for cpu)" in err
    assert err.count("\n") == 1 and not (gpu_node / "runs").exists()  # refused before anything was written


@needs_cpu_torch
def test_evals_refuse_and_override(gpu_node, capsys, monkeypatch):
    from evals import run as evals_run

    rc = evals_run.main(["--run-dir", str(gpu_node)])  # any directory: the platform check comes first
    assert rc == 2 and "is a CPU build" in capsys.readouterr().err
    monkeypatch.setenv(pc.ALLOW_CPU_ENV, "1")
    pc.require_working_cuda()  # the explicit override


@needs_cpu_torch
def test_cpu_machine_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    (tmp_path / ".setup-stamp").write_text("cpu 0123abcd\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert pc.venv_platform() == "cpu"
    pc.require_working_cuda()  # no error
    (tmp_path / ".setup-stamp").write_text("gpu 0123abcd\n")  # stamped gpu, yet a CPU torch (a broken install)
    with pytest.raises(pc.PlatformError, match="is a CPU build"):
        pc.require_working_cuda()
