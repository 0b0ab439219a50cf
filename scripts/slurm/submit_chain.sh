#!/usr/bin/env bash
# Submit N jobs of rl_train.sbatch in a chain: each starts when the previous one has ended, for any
# reason (--dependency=afterany), and resumes the run with ckpt.resume=latest. Once the run has reached
# train.total_steps, the remaining jobs find nothing to do and end at once.
#
#   scripts/slurm/submit_chain.sh N [sbatch options ...] -- [runner arguments ...]
#   scripts/slurm/submit_chain.sh 3 --time=04:00:00 -- --cfg cfg/qwen2.5_1.5b_gsm8k.yaml run.name=exp1
#   scripts/slurm/submit_chain.sh --dry-run 3 -- --cfg ...      # print the sbatch commands only
#
# Give every chain its own run.name: each job resumes whatever that run directory holds.
# Prints the job ids, one per line (the first line is the first job).
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
n=${1:-}
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [--dry-run] N [sbatch options ...] -- [runner arguments ...]" >&2; exit 2; }
shift
sbatch_opts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do sbatch_opts+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/rl_train.sbatch"

prev=""
for i in $(seq 1 "$n"); do
  dep=()
  [[ -n "$prev" ]] && dep=("--dependency=afterany:$prev")
  cmd=(sbatch --parsable "${dep[@]}" "${sbatch_opts[@]}" "$script" "$@")
  if [[ $dry_run == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    prev="JOB$i"
  else
    prev=$("${cmd[@]}")
    prev=${prev%%;*}  # --parsable prints "id" or "id;cluster"
    echo "$prev"
  fi
done
