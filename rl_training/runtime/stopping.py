"""Stop cleanly on a signal: SLURM's time-limit warning (`#SBATCH --signal=B:USR1@300`) or a plain `kill -USR1`.

The handler only sets a flag. At the top of every step all ranks all-reduce it (max), so a signal that
reached any one rank stops every rank at the same step: no rank leaves a collective behind. The runner
then checkpoints and exits with STOPPED_EXIT_CODE (rl_training/base/exit_codes.py), and a chained job resumes
with `ckpt.resume=latest`.

Under SLURM the workers start with the signal blocked (rl_training/cluster/launch.py): one that arrives
while they are still importing stays pending and is delivered here, the moment the handler is in place. One
that arrives before the workers exist reaches only the launcher, which turns it into the file named by
RL_STOP_FILE; `agreed` counts that file as the signal.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from rl_training.base import dist

# EX_TEMPFAIL from sysexits.h: stopped before train.total_steps on request, after a checkpoint; run it again.


class StopOnSignal:
    """Context manager: installs the handler (main thread only) and restores the previous one on exit."""

    def __init__(self, name: str):
        self.name = name
        self.signum = None if name == "none" else signal.Signals[name]
        self.received = False
        self.stop_file = os.environ.get("RL_STOP_FILE")  # the launcher's record of a signal (slurm_launch)
        self._previous = None
        self._was_blocked = False

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is not threading.main_thread():
            self.signum = None  # Python runs handlers in the main thread only: nothing to install here
        if self.signum is not None:
            self._previous = signal.signal(self.signum, self._handle)
            self._was_blocked = self.signum in signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.signum})
        return self

    def __exit__(self, *exc) -> None:
        if self.signum is not None:
            if self._was_blocked:  # block again first, so that a late signal waits instead of killing
                signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})
            signal.signal(self.signum, self._previous)

    def _handle(self, signum, frame) -> None:
        # No printing here: the handler can run in the middle of another print on the main thread.
        self.received = True

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank if the signal reached any rank (or its node's launcher)."""
        if self.stop_file and not self.received and os.path.exists(self.stop_file):
            self.received = True
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        return bool(dist.all_reduce_(flag, "max").item() > 0)
