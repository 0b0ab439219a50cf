"""Config resolution in one place: after loading, `resolve` fills every defaulted or derived value (the rollout
backend and train.drop_zero_adv_groups for 'auto', the objective's clip bounds, absolute local paths, the upload
target from RL_SYNC_*, the per-rank batch) and returns them frozen. Both runners, evals and synthesize use it;
nothing edits a config after it."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from rl_training.config.plugins import load_correction, load_objective, split_spec
from rl_training.config.rules import check_sync_target
from rl_training.config.schema import Config, ConfigError, Derived, SyncCfg, derive, get_key

# Keys that may name a local file or directory. They can also hold a hub id or a `datasets` name (and
# ckpt.resume 'none' / 'latest'), which are not paths and are kept as they are.
PATH_KEYS = [
    "model.name_or_path",
    "data.train",
    "data.eval",
    "ckpt.resume",
    "search.corpus",
    "search.bm25_index",
    "sft.gold_episodes",
]


# Keys that may name a user's file, 'path/to/file.py:NAME' (config/plugins.py).
SPEC_KEYS = ["task.name", "loss.type", "loss.correction", "rollout.backend"]


def absolute_path(value: str) -> str:
    """`value` as an absolute path when it names something on disk, else unchanged (a hub id such as
    'Qwen/Qwen2.5-1.5B-Instruct'). A `datasets` spec 'DIR[:config]@split' whose DIR is local gets an
    absolute DIR. Symlinks are kept (os.path.abspath, not resolve)."""
    if not value or os.path.isabs(value):
        return value
    if Path(value).expanduser().exists():
        return os.path.abspath(os.path.expanduser(value))
    name, at, split = value.partition("@")
    name, colon, config = name.partition(":")
    if at and name and Path(name).expanduser().exists():
        return os.path.abspath(os.path.expanduser(name)) + colon + config + at + split
    return value


def resolve_paths(cfg: Config) -> None:
    """Local paths in PATH_KEYS, run.output_dir (always local) and a user file's path in SPEC_KEYS made absolute,
    in place: a saved config.yaml then means the same from any working directory (evals.run reads the
    checkpoints' ones)."""
    for key in PATH_KEYS:
        value = get_key(cfg, key)
        if key != "ckpt.resume" or value not in ("none", "latest"):
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, absolute_path(value))
    cfg.run.output_dir = os.path.abspath(os.path.expanduser(cfg.run.output_dir))
    for key in SPEC_KEYS:
        section, name = key.split(".")
        form, where, attr = split_spec(getattr(getattr(cfg, section), name))
        if form == "file" and not os.path.isabs(where) and Path(where).expanduser().exists():
            setattr(getattr(cfg, section), name, f"{os.path.abspath(os.path.expanduser(where))}:{attr}")


@dataclass(frozen=True)
class Resolved:
    """A config after `resolve`: every section refuses assignment (a dataclasses.replace copy does not)."""

    cfg: Config
    derived: Derived | None  # None when resolved without a world size (evals, synthesize)


def resolve(
    cfg: Config, world_size: int | None = None, *, backend: bool = True, objective: bool = False, upload: bool = False
) -> Resolved:
    """The one place a loaded config gets its resolved values, on a frozen copy (`cfg` is left as it was):
    local paths absolute (a saved config.yaml means the same from any directory: evals.run reads the
    checkpoints' ones); with `backend`, rollout.backend 'auto' -> what is installed; with `objective`, loss.type
    and loss.correction loaded (a user's file imported) and checked, loss.tis_cap read into loss.correction, unset
    loss.clip_low/high -> the objective's paper values; with a `world_size`, the derived per-rank batch (its
    divisibility checked); with `upload`, sync.* filled from RL_SYNC_* and checked (every rank calls it: a
    ConfigError must not stop rank 0 alone). What is resolved is saved and logged as such."""
    cfg = _thaw(copy.deepcopy(cfg))  # resolving a resolved config (evals re-resolve checkpoints' ones) is allowed
    resolve_paths(cfg)
    if backend:
        cfg.rollout.backend = resolve_backend_name(cfg.rollout.backend)
    if objective:  # a user's loss file is imported here, before any model loads: a bad spec is one line
        chosen = load_objective(cfg.loss)
        load_correction(cfg.loss)
        cfg.loss.correction, cfg.loss.correction_args = cfg.loss.correction_spec()
        if cfg.loss.clip_low is None:
            cfg.loss.clip_low = chosen.clip_low
        if cfg.loss.clip_high is None:
            cfg.loss.clip_high = chosen.clip_high
    if cfg.train.drop_zero_adv_groups == "auto":  # exact only without a KL term (algs/objectives.py)
        cfg.train.drop_zero_adv_groups = cfg.loss.kl_coef == 0
    if cfg.probe.advisor and "unit" not in cfg.probe.gns_levels:  # the advisor reads the unit level's capture
        cfg.probe.gns_levels = ["unit", *cfg.probe.gns_levels]
    derived = derive(cfg, world_size) if world_size is not None else None
    if upload:
        resolve_target(cfg.sync, derive(cfg, world_size or 1).run_dir)
    return Resolved(cfg=freeze(cfg), derived=derived)


class FrozenConfigError(AttributeError):
    pass


def _refuse_after_freeze(self, name: str, value) -> None:
    if self.__dict__.get("_frozen_"):
        raise FrozenConfigError(f"{type(self).__name__}.{name}: a resolved config is frozen (edit it before resolve)")
    object.__setattr__(self, name, value)


_FROZEN: dict[type, type] = {}


def _thaw(cfg: Config) -> Config:
    """The inverse of `freeze`, in place (on a copy: see resolve)."""
    for obj in (cfg, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg))):
        if obj.__dict__.pop("_frozen_", False):
            object.__setattr__(obj, "__class__", type(obj).__mro__[1])
    return cfg


def freeze(cfg: Config) -> Config:
    """`cfg` and each of its sections, in place, switched to a subclass that refuses assignment (isinstance,
    dataclasses.fields/asdict and deepcopy keep working); returns `cfg`."""
    for obj in (cfg, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg))):
        cls = type(obj)
        if cls not in _FROZEN.values():
            if cls not in _FROZEN:
                _FROZEN[cls] = type(cls.__name__, (cls,), {"__setattr__": _refuse_after_freeze, "__slots__": ()})
            object.__setattr__(obj, "__class__", _FROZEN[cls])
        object.__setattr__(obj, "_frozen_", True)
    return cfg


def resolve_backend_name(name: str) -> str:
    """'auto' -> 'vllm' where vLLM is installed, else 'hf'."""
    if name != "auto":
        return name
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


SYNC_ENV_FALLBACK = {"remote": "RL_SYNC_REMOTE", "bucket": "RL_SYNC_BUCKET", "path": "RL_SYNC_PATH"}


def resolve_target(cfg: SyncCfg, run_dir: Path, env=os.environ) -> None:
    """Fill empty remote/bucket/path from RL_SYNC_* and validate (every rank calls it: a ConfigError must not
    stop rank 0 alone)."""
    for key, var in SYNC_ENV_FALLBACK.items():
        if not getattr(cfg, key):
            setattr(cfg, key, env.get(var, ""))
    where = "sync (config or RL_SYNC_* environment): "
    check_sync_target(cfg.remote, cfg.bucket, cfg.path, where)
    if not cfg.remote and (cfg.bucket or cfg.path):
        raise ConfigError(f"{where}sync.bucket/sync.path are set but sync.remote is empty")
    if cfg.remote and set('"$`\\\n') & set(str(Path(run_dir).resolve())):
        raise ConfigError(f"{where}the run directory {run_dir} has a character rclone-python cannot quote")
