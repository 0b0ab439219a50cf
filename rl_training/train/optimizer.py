"""AdamW over the trainable parameters and its learning-rate schedule (linear warmup, then constant, cosine or
linear decay), shared by the RL and SFT runners."""

from __future__ import annotations

import math

import torch


def build_optimizer(params: list[torch.nn.Parameter], optim_cfg, total_optimizer_steps: int):
    opt = torch.optim.AdamW(
        params,
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(optim_cfg.warmup_steps, optim_cfg.schedule, total_optimizer_steps)
    )


def lr_lambda(warmup: int, schedule: str, total: int):
    """Multiplier of the peak lr at optimizer step `s` (0-based): linear warmup, then the schedule."""

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac

    return f
