#!/usr/bin/env bash
# The optional TRL environment of the side-by-side benchmark (scripts/bench_trl.py), never a dependency of
# the project: .venv-trl is a venv of its own that sees the project's .venv (a .pth line adds its
# site-packages) and adds TRL, so both trainers run on exactly the same torch/transformers/peft builds.
#   scripts/setup_trl.sh        # after scripts/setup.sh; a no-op when up to date
set -euo pipefail
cd "$(dirname "$0")/.."

TRL_VERSION=1.16.0
[ -x .venv/bin/python ] || { echo "setup_trl: run scripts/setup.sh first (.venv is missing)" >&2; exit 2; }
if [ -x .venv-trl/bin/python ] && .venv-trl/bin/python -c "import trl, sys; sys.exit(trl.__version__ != '$TRL_VERSION')" 2>/dev/null; then
  echo "setup_trl: .venv-trl is up to date (trl $TRL_VERSION)"
  exit 0
fi
base_python=$(readlink -f .venv/bin/python)
"$base_python" -m venv .venv-trl
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
own=$(.venv-trl/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path) so the .venv's own .pth files (the editable install) are processed too.
echo "import site; site.addsitedir('$site')" > "$own/_rl_training_base.pth"
# --no-deps: TRL's requirements (accelerate, datasets, transformers, ...) are the .venv's, unchanged.
.venv-trl/bin/pip install --quiet --no-deps "trl==$TRL_VERSION"
.venv-trl/bin/python -c "import trl, torch, rl_training; print('setup_trl: trl', trl.__version__, '| torch', torch.__version__)"
