#!/usr/bin/env bash
# Set up (or update) this project on a Lambda GPU instance (Ubuntu + Lambda Stack); see lambda/README.md.
#
#   bash lambda/setup.sh --fs /lambda/nfs/my-fs --repo-url git@github.com:me/rl_training.git
#   bash lambda/setup.sh --dry-run ...        # print every command instead of running it
#
# Options (environment variable in brackets):
#   --fs DIR         persistent filesystem mount [RL_FS]; default: the only directory under /lambda/nfs
#   --repo-url URL   repository to clone [RL_REPO_URL]; default: the checkout this script is in
#   --ref REF        branch or tag to check out [RL_REPO_REF]; default: main
#   --dir DIR        where the code lives, on the instance's local disk [RL_DIR]; default: ~/rl_training
#   --platform P     gpu (default) or cpu, passed to scripts/setup.sh
#   --dry-run        print the commands, change nothing
#
# What it does: installs system packages; clones the repository, or fast-forwards it (code is synced by
# git, never copied by hand); lays out FS/rl/{runs,models,data,hf_cache} on the persistent filesystem and
# links runs/ models/ data/ of the checkout to them (they survive the instance); builds .venv on the local
# disk (scripts/setup.sh); writes ~/.rl_training_env (paths only). Credentials are never written anywhere:
# they stay in the environment of the shell that runs the training (lambda/README.md, "Credentials").
set -euo pipefail

dry_run=0
fs=${RL_FS:-}
repo_url=${RL_REPO_URL:-}
ref=${RL_REPO_REF:-main}
dir=${RL_DIR:-$HOME/rl_training}
platform=gpu
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --fs) fs=${2:?--fs needs a directory}; shift ;;
    --repo-url) repo_url=${2:?--repo-url needs a URL}; shift ;;
    --ref) ref=${2:?--ref needs a branch or tag}; shift ;;
    --dir) dir=${2:?--dir needs a directory}; shift ;;
    --platform) platform=${2:?--platform needs gpu or cpu}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

log() { echo "[lambda/setup] $*"; }
die() { echo "[lambda/setup] error: $*" >&2; exit 2; }
# run CMD...: execute, or print it (shell-quoted) in dry-run mode
run() {
  if [[ $dry_run == 1 ]]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi
}
# write_file PATH: stdin to PATH, or show it in dry-run mode
write_file() {
  if [[ $dry_run == 1 ]]; then echo "+ write $1:"; sed 's/^/|   /'; else cat >"$1"; fi
}

case "$platform" in gpu|cpu) ;; *) die "--platform must be gpu or cpu" ;; esac
if [[ -z "$fs" ]]; then
  mapfile -t mounts < <(find /lambda/nfs -mindepth 1 -maxdepth 1 -type d 2>/dev/null || true)
  [[ ${#mounts[@]} -eq 1 ]] || die "pass --fs /lambda/nfs/<name> (found ${#mounts[@]} filesystems under /lambda/nfs)"
  fs=${mounts[0]}
fi
if [[ ! -d "$fs" ]]; then
  [[ $dry_run == 1 ]] || die "$fs is not a directory: attach the persistent filesystem when launching the instance"
  log "note: $fs does not exist (dry run, continuing)"
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
[[ $(uname -m) != aarch64 ]] || log "aarch64 (GH200): see lambda/README.md and docs/gpu.md (GH200) for the GPU stack on Arm"
log "arch $(uname -m), persistent filesystem $fs, code in $dir (ref $ref), platform $platform"

# 1. System packages (Lambda Stack already has the NVIDIA driver and CUDA).
run "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
run "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  git python3-venv python3-dev rclone tmux

# 2. Code, by git only.
if [[ -z "$repo_url" ]]; then
  repo_url=$(git -C "$here" remote get-url origin 2>/dev/null) || die "pass --repo-url (no origin remote in $here)"
fi
if [[ -d "$dir/.git" || ( $dry_run == 1 && "$dir" == "$here" ) ]]; then
  run git -C "$dir" fetch --tags origin
  run git -C "$dir" checkout "$ref"
  run git -C "$dir" pull --ff-only origin "$ref"
else
  run git clone --branch "$ref" "$repo_url" "$dir"
fi

# 3. Persistent layout: outputs, models, data and the HF cache live on the filesystem, code and venv do not.
root="$fs/rl"
run mkdir -p "$root/runs" "$root/models" "$root/data" "$root/hf_cache"
for name in runs models data; do
  if [[ -e "$dir/$name" && ! -L "$dir/$name" ]]; then
    die "$dir/$name exists and is not a link; move its contents to $root/$name first"
  fi
  run ln -sfn "$root/$name" "$dir/$name"
done

# 4. The virtual environment, on the local disk (imports from NFS are slow).
run "$dir/scripts/setup.sh" "$platform"

# 5. Paths for later shells; no credentials in this file.
write_file "$HOME/.rl_training_env" <<EOF
# written by lambda/setup.sh: paths only. Credentials stay in the environment (lambda/README.md).
export RL_FS=$(printf '%q' "$fs")
export HF_HOME=$(printf '%q' "$root/hf_cache")
export PATH=$(printf '%q' "$dir/.venv/bin"):\$PATH
EOF

# 6. Which credentials the environment provides (names only, never values).
for var in HF_TOKEN AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY; do
  if [[ -n "${!var:-}" ]]; then log "credential $var: set"; else log "credential $var: not set"; fi
done
remotes=$(env | sed -n 's/^RCLONE_CONFIG_\([A-Z0-9_]*\)_TYPE=.*/\1/p' | tr '\n' ' ')
log "rclone remotes from RCLONE_CONFIG_*_TYPE: ${remotes:-none}"
log "done. Next: source ~/.rl_training_env; tmux new -s rl; then see lambda/README.md"
