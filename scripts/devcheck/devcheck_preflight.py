"""Stage 0 of device_check.sh: the environment, as lines for env.txt, and one `preflight` row in OUT/checks.jsonl.

    python3 devcheck_preflight.py --out OUT [--device cuda|cpu]

The row is FAIL, naming the first cause, when the later stages cannot mean anything: no torch, no CUDA where the
check asked for it, or the project or its training stack (transformers, peft) not importable. device_check.sh then
skips those stages, so the table shows one clear row instead of every check failing the same way. The installed
vLLM is reported in one line: the pinned version (requirements-gpu.txt), another site version, or absent (the
HF-only path). Exit status 0 when the row passes, else 3.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path.cwd()
sys.path.insert(0, str(REPO / "scripts"))
from gpu_check import pinned_vllm, vllm_line  # noqa: E402 - make gpu-check prints the same line at its start
MODULES = ("transformers", "peft", "accelerate", "tokenizers", "safetensors", "numpy", "math_verify", "bm25s")
MODULES += ("datasets", "triton", "vllm", "flash_attn", "tensorboard", "yaml", "pytest")


def version_of(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is the row's value, not a crash of the check
        return f"MISSING ({type(e).__name__})"
    return f"{getattr(mod, '__version__', '?'):12s} {getattr(mod, '__file__', '')}"


def problem(device: str) -> str | None:
    """The first reason the later stages could not run, or None."""
    if sys.version_info < (3, 11):  # noqa: UP036 - the site image's python3 may be older than the project's
        return f"Python {platform.python_version()} is older than 3.11"
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch does not import: {type(e).__name__}: {e}"
    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"CUDA was asked for but torch {torch.__version__} sees no usable GPU (torch.cuda.is_available() is False)"
        )
    for name in ("transformers", "peft", "rl_training.runners.rl_runner"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            first = str(e).splitlines()[0][:160] if str(e) else ""
            return f"{name} does not import: {type(e).__name__}: {first}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    t0 = time.time()
    print("python", platform.python_version(), platform.machine())
    try:
        import torch

        cuda = torch.cuda.is_available()
        print("torch", torch.__version__, "cuda", torch.version.cuda, "available", cuda)
        if cuda:
            p = torch.cuda.get_device_properties(0)
            print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "cc", f"{p.major}.{p.minor}")
    except Exception as e:  # noqa: BLE001
        print("torch", f"MISSING ({type(e).__name__})")
    for name in MODULES:
        print(f"{name:14s} {version_of(name)}")
    try:
        import vllm

        version = vllm.__version__
    except Exception:  # noqa: BLE001 - an unimportable vLLM is the HF-only path
        version = None
    print(vllm_line(version, pinned_vllm()), flush=True)
    why = problem(a.device)
    row = {
        "check": "preflight",
        "result": "FAIL" if why else "PASS",
        "value": why
        or f"Python {platform.python_version()}, torch, the project and its stack import; device {a.device}",
        "expected": "the environment the later stages need",
        "s": round(time.time() - t0, 1),
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "checks.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print("devcheck " + json.dumps(row), flush=True)
    return 3 if why else 0


if __name__ == "__main__":
    sys.exit(main())
