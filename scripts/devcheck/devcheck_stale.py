"""Run the RL runner on the HF backend with a weight sync that does nothing from the n-th on (device_check.sh's
stale-sync row where the image has no vLLM).

    python3 devcheck_stale.py N --cfg ... key=value ...      # exit status: the runner's (70 expected)

The HF backend samples with the trainer's own model, so its sync only counts the policy version its completions
carry (rollout/hf.py). Skipping that count from sync N on is the HF twin of RL_FAULT_INJECT=vllm.skip_sync@N (a sync
that silently pushes nothing, after which the engine keeps its old weight-version tag): step N + 1's batch carries
version N - 1 while the trainer holds N, and the weight-state guard must checkpoint that step and stop the run with
exit status 70 (train/weight_guard.py), on the card, through every collective and file write of that path.
"""

from __future__ import annotations

import sys


def main() -> int:
    skip_from, argv = int(sys.argv[1]), sys.argv[2:]
    from rl_training.rollout.hf import HFBackend
    from rl_training.runners import rl_runner

    real = HFBackend.sync_weights
    calls = [0]

    def sync_weights(self, model) -> None:
        calls[0] += 1
        if calls[0] < skip_from:
            real(self, model)

    HFBackend.sync_weights = sync_weights
    print(f"devcheck_stale: the HF backend's syncs from the {skip_from}th on do nothing", flush=True)
    return rl_runner.main(argv)


if __name__ == "__main__":
    sys.exit(main())
