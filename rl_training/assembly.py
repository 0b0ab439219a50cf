"""Builders the runners share: seeding, threads, optimizer and schedule, run directory and resume choice."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import numpy as np
import torch

from rl_training.checkpoint import (
    CheckpointError,
    find_latest_intact,
    list_checkpoints,
    resume_changes,
    set_aside_later,
    validate_checkpoint,
)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_cpu_threads() -> None:
    """Split the cores this process may run on (its affinity mask, e.g. under taskset) between the ranks of
    this node (torchrun sets LOCAL_WORLD_SIZE)."""
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


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


def resolve_resume(resume: str, run_dir: Path, config_yaml: str | None = None) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start; refuses to clobber an existing run.

    Resuming from step s moves run_dir's checkpoints after s aside (rank 0, `set_aside_later`), so that
    neither `latest` nor keep-last pruning ever mixes the abandoned history with the new one."""
    if resume == "none":
        if list_checkpoints(run_dir):
            raise CheckpointError(
                f"{run_dir} already has checkpoints; pass ckpt.resume=latest to continue "
                "it, or choose another run.name (nothing was changed)"
            )
        return None
    path = find_latest_intact(run_dir) if resume == "latest" else Path(resume)
    if path is None:
        return None
    step = validate_checkpoint(path)
    # config_yaml (the resolved config): refuse a changed adapter shape or scale before anything is moved,
    # and say what else differs from the checkpoint's saved config
    changes = resume_changes(path, config_yaml) if config_yaml is not None else []
    if int(os.environ.get("RANK", 0)) == 0:
        if changes:
            print(f"note: resuming {path} with changed settings: {'; '.join(changes)}", flush=True)
        moved = set_aside_later(run_dir, step)
        if moved:
            print(
                f"note: resuming from step {step}: moved the later checkpoints {', '.join(moved[1])} "
                f"and a copy of metrics.jsonl to {moved[0]} (nothing deleted)",
                flush=True,
            )
    return path
