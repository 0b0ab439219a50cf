"""Refuse to start on a GPU machine whose CUDA does not work, instead of training silently on CPU.

A venv that scripts/setup.sh built on a GPU-less login node holds the CPU torch that the sbatch job then
uses; a driver older than the one the CUDA wheels need disables CUDA. torch then quietly reports no GPU and
the run crawls on CPU (or vLLM fails with an unrelated-looking error). The runners call
`require_working_cuda()` first. A machine is a GPU platform when nvidia-smi lists a GPU or the venv was
built for gpu (the first word of .venv/.setup-stamp, written by scripts/setup.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rl_training.config.schema import ConfigError

# CUDA major version of the torch wheel -> the oldest NVIDIA driver branch it runs on (NVIDIA's CUDA
# toolkit release notes, "minor version compatibility": CUDA 13.x needs R580, CUDA 12.x needs R525).
MIN_DRIVER = {13: 580, 12: 525}
ALLOW_CPU_ENV = "RL_ALLOW_CPU"  # =1: run on CPU anyway (e.g. evals on a GPU venv's login node)


class PlatformError(ConfigError):
    """The machine, not the config, is wrong; printed as one line like a config error (exit status 2)."""


@dataclass(frozen=True)
class Platform:
    gpus_listed: int  # GPUs nvidia-smi lists (0: no nvidia-smi, or it failed)
    driver: str | None  # NVIDIA driver version from nvidia-smi, e.g. "570.86.15"
    venv_platform: str | None  # "cpu" / "gpu" as scripts/setup.sh built the venv; None if unknown
    torch_version: str  # e.g. "2.13.0+cpu"
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    cuda_available: bool  # torch.cuda.is_available()
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as set (None when unset)


def nvidia_smi() -> tuple[int, str | None]:
    """(GPUs listed, driver version) from nvidia-smi; (0, None) when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, None
    try:
        r = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0, None
    rows = [line.split(",") for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []
    return len(rows), (rows[0][-1].strip() if rows else None)


def venv_platform(prefix: str | None = None) -> str | None:
    stamp = Path(prefix or sys.prefix) / ".setup-stamp"
    try:
        words = stamp.read_text().split()
    except OSError:
        return None
    return words[0] if words and words[0] in ("cpu", "gpu") else None


def probe() -> Platform:
    import torch

    gpus, driver = nvidia_smi()
    return Platform(
        gpus_listed=gpus,
        driver=driver,
        venv_platform=venv_platform(),
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def min_driver(torch_cuda: str | None) -> int | None:
    """The oldest driver branch (e.g. 580) torch's CUDA version needs; None when unknown."""
    try:
        return MIN_DRIVER.get(int(str(torch_cuda).split(".")[0]))
    except ValueError:
        return None


def driver_major(driver: str | None) -> int | None:
    try:
        return int(str(driver).split(".")[0])
    except ValueError:
        return None


def cuda_problem(p: Platform) -> str | None:
    """One line naming why CUDA does not work on a GPU platform; None when it works or the machine is a CPU one."""
    if p.cuda_available or not (p.gpus_listed or p.venv_platform == "gpu"):
        return None
    fix_venv = "run `scripts/setup.sh gpu` on a GPU node (it reinstalls the CUDA torch)"
    if p.torch_cuda is None:
        built = f"this venv was set up for {p.venv_platform}" if p.venv_platform else "venv of unknown origin"
        return f"torch {p.torch_version} is a CPU build ({built}) on a GPU machine: {fix_venv}"
    need, have = min_driver(p.torch_cuda), driver_major(p.driver)
    if need and have is not None and have < need:
        return (
            f"NVIDIA driver {p.driver} is older than R{need}, which torch {p.torch_version} (CUDA {p.torch_cuda}) "
            f"needs: update the driver to >= {need} (or ask the cluster admins for nodes that have it)"
        )
    if p.visible_devices is not None and p.visible_devices.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={p.visible_devices!r} hides every GPU: unset it or list the GPUs to use"
    if not p.gpus_listed:
        return (
            "this venv was built for gpu but no GPU is visible (nvidia-smi is missing or lists none): run on a "
            f"GPU node, or set {ALLOW_CPU_ENV}=1 to run on CPU anyway"
        )
    return (
        f"torch.cuda.is_available() is False although nvidia-smi lists {p.gpus_listed} GPU(s) (driver {p.driver}, "
        f"torch {p.torch_version}, CUDA {p.torch_cuda}): `python -c 'import torch; torch.cuda.init()'` names the cause"
    )


def require_working_cuda() -> None:
    """Raise PlatformError on a GPU platform without a working CUDA (see the module docstring)."""
    if os.environ.get(ALLOW_CPU_ENV) == "1":
        return
    problem = cuda_problem(probe())
    if problem:
        raise PlatformError(f"{problem} (refusing to run on CPU; {ALLOW_CPU_ENV}=1 overrides)")
