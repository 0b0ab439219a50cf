"""The trainer-vs-sampler canary: it only observes. On the sampled tokens of each micro-batch in the update's first
epoch it meters the log-prob gap |log pi_train - log pi_rollout| (overall, per sequence for the rollout samples,
per turn for multi-turn episodes) and the importance ratio rho = pi_train / pi_rollout. The weight guard
(train/weight_guard.py) judges the gap; the off-policy correction (train/learner.py, algs/corrections.py) computes
its own weights beside the loss."""

from __future__ import annotations

import torch

from rl_training.base.meter import Meter
from rl_training.train.batches import MicroBatch

MAX_TURNS = 32  # the per-turn canary's names: rollout/logp_diff_turn1..32 (multiturn.max_turns <= 32)


def rollout_canary(meter: Meter, logp: torch.Tensor, mb: MicroBatch) -> None:
    """Observes, epoch 0: the trainer-vs-sampler log-prob gap and importance ratio rho = pi_train / pi_rollout on
    the sampled tokens, overall, per sequence (kept for the rollout samples) and per turn (multi-turn).
    Masked arithmetic rather than boolean indexing, whose data-dependent size would sync with the host; a max
    over masked-out tokens is -inf, which the meter does not log (no token, no measurement)."""
    m = mb.mask.bool()
    log_rho = torch.where(m, logp - mb.rollout_logp, 0.0)
    gap, tokens = log_rho.abs(), m.sum()
    meter.mean("rollout/logp_diff_mean", gap.sum(), per=tokens)
    meter.max("rollout/logp_diff_max", gap.masked_fill(~m, -torch.inf).max())
    meter.mean("is/ratio_mean", torch.where(m, log_rho.exp(), 0.0).sum(), per=tokens)
    meter.max("is/ratio_max", log_rho.exp().masked_fill(~m, -torch.inf).max())
    meter.keep("logp_gap", gap.sum(1) / m.sum(1).clamp(min=1))  # per sequence: mb.rows, micro-batch by micro-batch
    if mb.turn is not None:  # per turn: 0 (observations, prompt, padding) collects nothing that is read
        per_turn = torch.zeros((2, MAX_TURNS + 1), dtype=torch.float64, device=logp.device)
        t = mb.turn.flatten()
        per_turn[0].scatter_add_(0, t, gap.flatten().double())
        per_turn[1].scatter_add_(0, t, mb.mask.flatten().double())
        for k in range(1, MAX_TURNS + 1):
            meter.mean(f"rollout/logp_diff_turn{k}", per_turn[0, k], per=per_turn[1, k])
