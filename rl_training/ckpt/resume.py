"""Which checkpoint a run resumes from (ckpt.resume), and the refusal to start over an existing run."""

from __future__ import annotations

import os
from pathlib import Path

from rl_training.ckpt.store import (
    CheckpointError,
    find_latest_intact,
    list_checkpoints,
    resume_changes,
    set_aside_later,
    validate_checkpoint,
)


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
