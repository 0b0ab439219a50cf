"""Stage 0 of device_check.sh: the environment, as lines for env.txt, and the rows `wheels`, `pins` and `preflight`
in OUT/checks.jsonl.

    python3 devcheck_preflight.py --out OUT [--device cuda|cpu] [--wheels .whl --site DIR --wheels-rc N]

- wheels: what device_check.sh installed from .whl/ (scripts/devcheck/pack_wheels.py) into DIR, the folder the
  check's processes import first: FAIL when pip failed or a wheel is not there, WARN when no .whl/ came (the
  image's own stack is then what runs).
- pins: every version of torch, transformers, peft and vLLM that the processes of the check import and that differs
  from the pins (requirements-gpu.txt and what it includes; torch's in requirements-cpu.txt, the version vllm==X
  brings on GPU) is named, as a WARN: the rows below then test that version, not the project's.
- preflight: FAIL, naming the first cause, when the later stages cannot mean anything: no torch, no CUDA where the
  check asked for it, or the project or its training stack (transformers, peft) not importable. device_check.sh
  then skips those stages, so the table shows one clear row instead of every check failing the same way.
The installed vLLM is reported in one line: the pinned version, another site version, or absent (the HF-only path).
Exit status 0 when the preflight row passes, else 3.
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
from gpu_check import REPO as PROJECT  # noqa: E402
from gpu_check import pinned_vllm, pins, vllm_line  # noqa: E402 - make gpu-check prints the same line at its start

PINNED = ("torch", "transformers", "peft", "vllm")  # the versions the pins row compares
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


def project_pins() -> dict[str, str]:
    """The pinned version of each of PINNED: requirements-gpu.txt's, torch's from requirements-cpu.txt (the GPU file
    leaves torch to vllm==X, which brings the same version as a CUDA build)."""
    gpu = pins(PROJECT / "requirements-gpu.txt")
    return {n: pins(PROJECT / "requirements-cpu.txt")["torch"] if n == "torch" else gpu[n] for n in PINNED}


def pins_row(have: dict[str, str | None], pinned: dict[str, str]) -> dict:
    """WARN naming every version of PINNED that differs from its pin (a local build tag such as +cu130 is no
    difference; None: not importable), else PASS."""
    differ = [
        f"{n} {have[n] or 'absent'} (pinned {pinned[n]})" for n in PINNED if (have[n] or "").split("+")[0] != pinned[n]
    ]
    same = ", ".join(f"{n} {have[n]}" for n in PINNED)
    return {
        "check": "pins",
        "result": "WARN" if differ else "PASS",
        "value": "not the pins, the rows test these: " + "; ".join(differ) if differ else same,
        "expected": "torch, transformers, peft, vLLM at the pinned versions",
    }


def wheels_row(wheel_dir: Path, site: Path, pip_rc: int) -> dict:
    """What came of .whl/: every wheel's distribution installed in `site` (its dist-info), or why not."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    row = {"check": "wheels", "expected": f"every wheel of {wheel_dir.name}/ installed in the check's site folder"}
    if not wheels:
        return {**row, "result": "WARN", "value": f"no {wheel_dir.name}/ (pack_wheels.py): the image's own stack runs"}
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")} if site.is_dir() else set()
    names = [w.name.split("-")[:2] for w in wheels]
    missing = [f"{n}-{v}" for n, v in names if n.lower() not in installed]
    ok = pip_rc == 0 and not missing
    value = f"{len(wheels) - len(missing)} of {len(wheels)} installed ({', '.join(f'{n} {v}' for n, v in names)})"
    if pip_rc:
        value += f"; pip exit {pip_rc} (see logs/wheels.log)"
    if missing:
        value += f"; not installed: {', '.join(missing)}"
    return {**row, "result": "PASS" if ok else "FAIL", "value": value}


def imported_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PINNED:
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - not importable: the row says absent
            out[name] = None
    return out


def write_row(out: Path, row: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "checks.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print("devcheck " + json.dumps(row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--wheels", default="", help="the wheel folder device_check.sh installed from (.whl)")
    ap.add_argument("--site", default="", help="the folder it installed them into")
    ap.add_argument("--wheels-rc", type=int, default=0, help="pip's exit status")
    a = ap.parse_args()
    t0 = time.time()
    if a.wheels:
        write_row(Path(a.out), wheels_row(Path(a.wheels), Path(a.site), a.wheels_rc))
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
    write_row(Path(a.out), pins_row(imported_versions(), project_pins()))
    why = problem(a.device)
    row = {
        "check": "preflight",
        "result": "FAIL" if why else "PASS",
        "value": why
        or f"Python {platform.python_version()}, torch, the project and its stack import; device {a.device}",
        "expected": "the environment the later stages need",
        "s": round(time.time() - t0, 1),
    }
    write_row(Path(a.out), row)
    return 3 if why else 0


if __name__ == "__main__":
    sys.exit(main())
