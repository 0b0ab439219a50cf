"""Pack the pinned stack a GPU image may lack into .whl/ (git-ignored) for scripts/devcheck/device_check.sh.

    .venv/bin/python scripts/devcheck/pack_wheels.py [--python 3.12] [--out .whl] [--max-mib 40]

The lent GPU machine has no network and its image its own stack (seen: transformers 5.17.0, no vLLM, an unknown
peft): the check would test that, not ours. So the pinned wheels travel with the working tree, which may be 64 MiB
in all, the tree itself included (about 4 MB), and the check installs them there with no index and no dependencies
into a folder of its own, beside the image's CUDA torch (never torch, vLLM or anything CUDA: those stay the image's).

What is packed: PINNED at the versions requirements-gpu.txt (and the requirements.txt it includes) pins, read from
there; UNPINNED, requirements of those that the image may lack or have too old, at the version this venv resolved
(the stack every test here ran with). Wheels for CPython --python (the device's python3: 3.12 in
/work/.library/device/KINDS.md) on manylinux x86_64, one version of each (two would stop the whole install).
Writes .whl/PACKED: the interpreter and platforms the wheels are for (device_check.sh's rehearsal installs them
for that interpreter into a throwaway folder), then one line per wheel.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from gpu_check import pins  # noqa: E402 - the requirements files are read in one place

# The training stack the check's stages import (transformers, tokenizers, peft first: the image's differ), then what
# the project's modules and the pytest subset import that the image may not have (math-verify, bm25s, datasets,
# rclone-python: KINDS.md's package list has none of them).
PINNED = (
    "transformers", "tokenizers", "peft", "accelerate", "safetensors", "math-verify", "bm25s", "datasets",
    "rclone-python",
)  # fmt: skip
# transformers 5.19 needs regex >= 2025.10.22; math-verify latex2sympy2_extended and its antlr4 runtime; datasets
# dill and multiprocess. The image has the rest (huggingface-hub >= 1.31, numpy, pyyaml, tqdm, typer, fsspec, ...).
UNPINNED = ("regex", "latex2sympy2_extended", "antlr4-python3-runtime", "dill", "multiprocess")
NEVER = ("torch", "vllm", "triton", "nvidia")  # the image's CUDA stack: a wheel of these is refused
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def wanted() -> dict[str, str]:
    """name -> version to pack: the pins for PINNED, this venv's versions for UNPINNED."""
    pinned = pins()
    missing = [n for n in PINNED if n not in pinned]
    if missing:
        raise SystemExit(f"pack_wheels: requirements-gpu.txt pins no version of {', '.join(missing)}")
    return {**{n: pinned[n] for n in PINNED}, **{n: importlib.metadata.version(n) for n in UNPINNED}}


def download(specs: list[str], python: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS]]
    cmd += ["-d", str(out), *specs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"pack_wheels: pip download failed:\n{r.stderr[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12", help="the device's python3 version (X.Y)")
    ap.add_argument("--out", default=str(REPO / ".whl"))
    ap.add_argument("--max-mib", type=float, default=40.0, help="refuse a pack over this (the tree needs the rest)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one version of each: an old pin's wheel beside the new one stops the install
        old.unlink()
    versions = wanted()
    download([f"{n}=={v}" for n, v in versions.items()], a.python, out)
    wheels = sorted(out.glob("*.whl"))
    refused = [w.name for w in wheels if w.name.lower().startswith(NEVER)]
    if refused:
        raise SystemExit(f"pack_wheels: {', '.join(refused)} would replace the image's CUDA stack")
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if mib > a.max_mib:
        raise SystemExit(f"pack_wheels: {mib:.1f} MiB of wheels, over --max-mib {a.max_mib:g} (64 MiB travel in all)")
    lines = [f"python {a.python}", f"platforms {' '.join(PLATFORMS)}", *(w.name for w in wheels)]
    (out / "PACKED").write_text("\n".join(lines) + "\n")
    print(f"pack_wheels: {len(wheels)} wheels, {mib:.1f} MiB in {out} for CPython {a.python}:")
    for n, v in versions.items():
        print(f"  {n}=={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
