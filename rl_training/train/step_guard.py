"""Non-finite steps never reach the weights: a NaN or inf reward, loss or gradient norm skips the optimizer
step on every rank together, and too many skips in a row stop the run.

The decision is one max-all-reduce of per-quantity flags, so a NaN on one rank (its loss, or a reward only it
computed) skips the step everywhere and the adapters stay identical. A skipped step leaves the adapter, the
AdamW moments and step count, and the LR schedule exactly as they were; its rollouts are spent (the data
order does not replay them), and it is counted: train/skipped_steps (total) and train/nonfinite_<quantity>
(1 on the step that quantity was non-finite).
"""

from __future__ import annotations

import math

import torch

from rl_training.base import dist
from rl_training.base.errors import UserError

QUANTITIES = ("reward", "loss", "grad_norm")


class NonFiniteError(UserError, RuntimeError):
    """train.max_consecutive_skips optimizer steps in a row were skipped for non-finite values."""


def nonfinite_agreed(values: dict[str, float], device: torch.device) -> tuple[str, ...]:
    """Collective: the names of `values` that are NaN or inf on any rank (sorted; () when all are finite)."""
    flags = dist.reduce_max({k: 0.0 if math.isfinite(v) else 1.0 for k, v in values.items()}, device)
    return tuple(k for k in sorted(flags) if flags[k] > 0)


class SkipGuard:
    """Counts skipped steps across the run (checkpointed) and ends the run after `max_consecutive` in a row."""

    def __init__(self, max_consecutive: int, state: dict | None = None):
        self.max_consecutive = max_consecutive
        self.total = int((state or {}).get("total", 0))
        self.consecutive = int((state or {}).get("consecutive", 0))

    def record(self, step: int, skipped: tuple[str, ...]) -> dict[str, float]:
        """The step's train/skipped_* metrics; a warning (rank 0) names a skipped step and its quantities."""
        if skipped:
            self.total += 1
            self.consecutive += 1
            dist.print0(
                f"warning: step {step}: non-finite {', '.join(skipped)}; optimizer step skipped on every rank "
                f"({self.consecutive} in a row, the run stops at train.max_consecutive_skips={self.max_consecutive})"
            )
        else:
            self.consecutive = 0
        return {
            "train/skipped_steps": float(self.total),
            **{f"train/nonfinite_{q}": float(q in skipped) for q in QUANTITIES},
        }

    def check(self, step: int, last_checkpoint: str) -> None:
        """Raise NonFiniteError (on every rank: the counts are agreed) once the streak reaches the limit."""
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"steps {step - self.consecutive + 1}-{step}: {self.consecutive} optimizer steps in a row skipped for "
                f"non-finite values (train.max_consecutive_skips={self.max_consecutive}); the adapter was not "
                f"updated by them and {last_checkpoint} is intact: fix the cause (optim.lr, the reward), then "
                "ckpt.resume=latest"
            )

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}
