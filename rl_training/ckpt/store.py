"""Atomic checkpoints: run_dir/checkpoints/step_NNNNNN/{adapter/, optimizer.pt, scheduler.pt, rng_rank*.pt,
trainer_state.json, config.yaml, COMPLETE}.

Written into a hidden temp directory, fsynced, then renamed into place; `COMPLETE` is written last before
the rename, so neither a crash mid-write nor a half-copied directory is ever taken for a checkpoint, and it
records every file's size and sha256, so one changed or truncated later is refused (rl_training/ckpt/marker.py).
`adapter/` is peft's `save_pretrained` output, loadable by `PeftModel.from_pretrained` and by vLLM's
LoRA loader (`LoRARequest`; both tested against the merged policy). Every rank's RNG state is saved
(gathered to rank 0) so a resumed run samples exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from rl_training.base import dist
from rl_training.base.errors import UserError
from rl_training.ckpt.best import point
from rl_training.ckpt.marker import (
    COMPLETE,
    STEP_RE,
    CorruptCheckpointError,
    step_name,
    verify_marker,
    write_atomically,
)


class CheckpointError(UserError, RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """A save that failed half-way; the earlier checkpoints are untouched."""


def rng_state() -> dict:
    """This process's RNG streams. CUDA: the rank's own device only (dist.init_distributed set it current);
    saving every visible GPU's state made a resume that sees fewer GPUs fail."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():  # saved or loaded without a GPU: the CPU streams suffice
        return
    torch.cuda.set_rng_state(cuda)


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / step_name(step)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint that validates (marker, sizes, sha256); each newer one that does not is named
    in a printed note (rank 0) and passed over, never deleted."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(path)
        except CheckpointError as e:
            dist.print0(f"note: ckpt.resume=latest passes over {path.name}: {e}")
            continue
        return path
    return None


def abandoned_dir(parent: Path) -> Path:
    """A new, empty parent/abandoned_<time>[_n]/ for history that a restart sets aside (never deletes)."""
    stamp = time.strftime("%Y%m%d_%H%M%S")
    dest, n = parent / f"abandoned_{stamp}", 1
    while dest.exists():
        dest, n = parent / f"abandoned_{stamp}_{n}", n + 1
    dest.mkdir(parents=True)
    return dest


def set_aside_later(run_dir: Path, step: int) -> tuple[Path, list[str]] | None:
    """Move run_dir's checkpoint directories later than `step` (complete or not) into
    checkpoints/abandoned_<time>/, with a copy of metrics.jsonl as it was; None when there are none.

    Resuming from step s starts a new history after s. The later checkpoints belong to the abandoned one:
    left in place, `ckpt.resume=latest` would pick them and keep-last pruning (by step number) could delete
    the new checkpoints instead of them. Moved, never deleted: nothing saved is lost. The metrics copy keeps
    the abandoned steps' lines, which the resumed run's logger drops from metrics.jsonl."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    later = sorted(p for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir() and int(m.group(1)) > step)
    if not later:
        return None
    dest = abandoned_dir(root)
    for p in later:
        os.replace(p, dest / p.name)
    kept = list_checkpoints(run_dir)
    point(root, "latest", kept[-1][1].name if kept else None)
    if (root / "best").is_symlink() and not (root / "best").exists():  # the best was later: the next save names it
        point(root, "best", None)
    if (Path(run_dir) / "metrics.jsonl").exists():
        shutil.copy2(Path(run_dir) / "metrics.jsonl", dest / "metrics.jsonl")
    return dest, [p.name for p in later]


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    config_yaml: str,
    trainer_state: dict,
    keep_last: int,
    extra_dirs: dict[str, Path] | None = None,
    best: int | None = None,
) -> Path | None:
    """Collective: every rank calls it (RNG states are gathered); rank 0 writes. Returns the path on rank 0.
    A write that fails (disk full, permission denied) raises CheckpointWriteError on every rank together.
    `extra_dirs` (rank 0): directories copied in under the given relative names (past policy adapters).
    `best`: the step of the best checkpoint (ckpt.keep_best), which pruning keeps; `checkpoints/latest` and
    `checkpoints/best` then name the newest and the best (ckpt/best.py)."""
    states = dist.all_gather_objects(rng_state())
    final = ckpt_dir(run_dir, step)
    error = None
    if int(os.environ.get("RANK", 0)) == 0:

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp / "adapter")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            for r, st in enumerate(states):
                torch.save(st, tmp / f"rng_rank{r}.pt")
            (tmp / "config.yaml").write_text(config_yaml)
            for name, src in (extra_dirs or {}).items():
                shutil.copytree(src, tmp / name)
            (tmp / "trainer_state.json").write_text(
                json.dumps({**trainer_state, "step": step, "world_size": len(states)}, indent=2)
            )

        error = write_atomically(final, write)
        if error is None:
            for old_step, old in list_checkpoints(run_dir)[:-keep_last]:
                if old_step != best:
                    shutil.rmtree(old, ignore_errors=True)
            point(final.parent, "latest", final.name)
            kept = best is not None and ckpt_dir(run_dir, best).is_dir()
            point(final.parent, "best", step_name(best) if kept else None)
    error = dist.broadcast_object(error)  # also the barrier: no rank runs ahead of an unfinished save
    if error:
        raise CheckpointWriteError(error)
    return final if int(os.environ.get("RANK", 0)) == 0 else None


@dataclass
class Restored:
    step: int
    trainer_state: dict
    path: Path


def validate_checkpoint(path: Path) -> int:
    path = Path(path)
    m = STEP_RE.match(path.name)
    if not path.is_dir() or not m:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected .../checkpoints/step_NNNNNN)")
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker); refusing to resume")
    for name in (ADAPTER_FILE, "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        if not (path / name).exists():
            raise CheckpointError(f"{path}: missing {name}")
    try:
        verify_marker(path)
    except CorruptCheckpointError as e:
        raise CheckpointError(f"corrupt checkpoint: {e}") from None
    return int(m.group(1))


# Keys that define what the saved adapter means: resuming with other values would load wrong shapes or the
# same weights scaled differently.
ADAPTER_KEYS = ("lora.r", "lora.alpha", "lora.target_modules")  # also what evals.run compares across checkpoints
ADAPTER_FILE = "adapter/adapter_model.safetensors"


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def resume_changes(path: Path, config_yaml: str) -> list[str]:
    """The settings a resume changes against the checkpoint's saved config.yaml, as 'key: old -> new' lines
    (ckpt.resume aside); a changed adapter key (ADAPTER_KEYS) is a CheckpointError."""
    try:
        saved = _flat(yaml.safe_load((Path(path) / "config.yaml").read_text(encoding="utf-8")) or {})
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable config.yaml ({type(e).__name__})") from None
    now = _flat(yaml.safe_load(config_yaml))

    def same(k: str) -> bool:  # peft matches target_modules as a set: order does not change the adapter
        a, b = now.get(k), saved.get(k)
        return sorted(a) == sorted(b) if k == "lora.target_modules" and a and b else a == b

    changed = sorted(k for k in now.keys() | saved.keys() if k != "ckpt.resume" and not same(k))
    for k in changed:
        if k in ADAPTER_KEYS:
            raise CheckpointError(
                f"{path}: saved with {k}={saved.get(k)!r}, now {now.get(k)!r}; the adapter would not mean the "
                "same (resume with the saved value, or start a new run from it via model.name_or_path)"
            )
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed]


def load_cpu(path: Path):
    """torch.load onto the CPU (our own files: numpy RNG state and optimizer dicts need weights_only=False)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def load_adapter(model, path: Path) -> None:
    """Load a checkpoint's adapter into the peft model in place (resume and evals.run): every LoRA tensor
    must be present and fit, and none be left over (a module adapted then but not now, or the reverse)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / ADAPTER_FILE))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / ADAPTER_FILE}: unreadable ({e})") from None
    expected = get_peft_model_state_dict(model)
    missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = [k for k in expected.keys() & weights.keys() if weights[k].shape != expected[k].shape]
    if missing or extra or wrong:
        raise CheckpointError(
            f"{path / ADAPTER_FILE}: does not fit the model (missing {missing[:2]}, unexpected {extra[:2]}, "
            f"wrong shape {wrong[:2]})"
        )
    set_peft_model_state_dict(model, weights)


def load_checkpoint(path: Path, model, optimizer, scheduler, rank: int, world_size: int) -> Restored:
    """Restore adapter, optimizer, scheduler and this rank's RNG state. Call after the model is built."""
    path = Path(path)
    step = validate_checkpoint(path)
    load_adapter(model, path)
    # map_location="cpu": a GPU checkpoint loads on a CPU machine, and no rank puts state on GPU 0 (where
    # torch.load would restore CUDA tensors); Optimizer.load_state_dict moves the state to each param's device.
    optimizer.load_state_dict(load_cpu(path / "optimizer.pt"))
    scheduler.load_state_dict(load_cpu(path / "scheduler.pt"))
    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("world_size", 1) != world_size:
        raise CheckpointError(
            f"{path}: saved with world size {state.get('world_size')}, now {world_size}; "
            "per-rank RNG and data shards would not continue the same run"
        )
    set_rng_state(load_cpu(path / f"rng_rank{rank}.pt"))
    return Restored(step=step, trainer_state=state, path=path)
