#!/usr/bin/env bash
# TensorBoard on a Lambda instance, reachable only through an SSH tunnel (it listens on 127.0.0.1).
#
#   bash lambda/tensorboard.sh [--dry-run] [--port 6006] [--logdir runs]
#   # then on your own machine:  ssh -N -L 6006:localhost:6006 ubuntu@<instance ip>  and open http://localhost:6006
set -euo pipefail

dry_run=0
port=6006
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
logdir="$repo/runs"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --port) port=${2:?--port needs a number}; shift ;;
    --logdir) logdir=${2:?--logdir needs a directory}; shift ;;
    *) echo "tensorboard.sh: unknown option $1 (use --dry-run, --port, --logdir)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$port" =~ ^[0-9]+$ ]] || { echo "tensorboard.sh: --port must be a number" >&2; exit 2; }

ip=$(hostname -I 2>/dev/null | awk '{print $1}')
echo "On your own machine: ssh -N -L $port:localhost:$port ubuntu@${ip:-<instance ip>}  then open http://localhost:$port"
cmd=("$repo/.venv/bin/tensorboard" --logdir "$logdir" --host 127.0.0.1 --port "$port")
if [[ $dry_run == 1 ]]; then printf '+'; printf ' %q' "${cmd[@]}"; echo; else exec "${cmd[@]}"; fi
