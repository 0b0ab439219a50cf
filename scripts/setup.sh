#!/usr/bin/env bash
# Create or refresh the project's virtual environment at .venv; a no-op when it is already up to date.
#   scripts/setup.sh            # auto: gpu if nvidia-smi works, else cpu
#   scripts/setup.sh cpu|gpu
set -euo pipefail
cd "$(dirname "$0")/.."

platform="${1:-auto}"
if [ "$platform" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then platform=gpu; else platform=cpu; fi
fi
case "$platform" in cpu|gpu) ;; *) echo "setup.sh: platform must be cpu, gpu or auto, got '$platform'" >&2; exit 2;; esac

# bubblewrap: the sandbox of the code rewards (docs/code.md); installed here when root with apt-get.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap >/dev/null \
      || echo "setup: could not install bubblewrap (code rewards need it; docs/code.md)" >&2
  else
    echo "setup: code rewards need bubblewrap: sudo apt-get install -y bubblewrap (docs/code.md)" >&2
  fi
fi

python="${PYTHON:-python3}"
stamp=.venv/.setup-stamp
want="$platform $(cat requirements.txt "requirements-$platform.txt" pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date ($platform)"
  exit 0
fi

echo "setup: installing the $platform stack into .venv (a few minutes the first time)"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -r "requirements-$platform.txt"
if [ "$platform" = cpu ]; then
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/pip install --quiet --no-deps -e .
.venv/bin/python -c "import torch, transformers, peft, vllm; print('setup: torch', torch.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$stamp"
