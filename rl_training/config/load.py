"""Loading the config tree: YAML (repeated keys refused), dotted command-line overrides, per-field type and
bounds checks (the bounds are declared with each field in rl_training/config/schema.py), the combinations refused at
load, and the YAML a run saves. Unknown keys are errors naming the key and the nearest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from rl_training.algs.corrections import CORRECTIONS
from rl_training.algs.objectives import OBJECTIVES
from rl_training.config.plugins import BACKEND_NAMES, check_builtin
from rl_training.config.schema import GENERATED_SPLITS, Config, ConfigError, _field_types, all_keys


def _check_value(value: Any, tp: Any, key: str, meta: dict) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:  # typed: 1 == True would otherwise pass for a Literal holding True
        if not any(value == c and type(value) is type(c) for c in typing.get_args(tp)):
            choices = ", ".join(repr(c) for c in typing.get_args(tp))
            raise ConfigError(f"{key}={value!r} is not one of {choices}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key} must be a mapping with string keys, got {type(value).__name__} {value!r:.80}")
        return dict(value)
    if origin in (list, typing.List):  # noqa: UP006
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_check_value(v, item, f"{key}[{i}]", {}) for i, v in enumerate(value)]
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, str):  # PyYAML reads '1e-4' (no dot) as a string: accept it as the number it is
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):  # nan passes every >=/<= bound below, and inf turns into nan later
            raise ConfigError(f"{key}={value} must be a finite number")
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
    if meta.get("ge") is not None and value < meta["ge"]:
        raise ConfigError(f"{key}={value} must be >= {meta['ge']}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise ConfigError(f"{key}={value} must be > {meta['gt']}")
    if meta.get("le") is not None and value > meta["le"]:
        raise ConfigError(f"{key}={value} must be <= {meta['le']}")
    return value


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    """'unknown config key' with the nearest valid key: a close name in the same section first ('eval.evry' ->
    'eval.every', not 'ckpt.every'), then the same name in another section ('train.lr' -> 'optim.lr'), then
    the closest whole dotted key ('trian.total_steps' -> 'train.total_steps')."""
    section, _, leaf = key.rpartition(".")
    same = [v for v in valid if v.rpartition(".")[0] == section]
    near = difflib.get_close_matches(leaf, [v.rpartition(".")[2] for v in same], n=1)
    if near:
        full: str | None = f"{section}.{near[0]}" if section else near[0]
    else:
        full = next((v for v in valid if v.rpartition(".")[2] == leaf), None)
        full = full or next(iter(difflib.get_close_matches(key, valid, n=1)), None)
    hint = f"; did you mean '{full}'?" if full else ""
    return ConfigError(f"{where}unknown config key '{key}'{hint}")


class DuplicateKeyError(yaml.constructor.ConstructorError):
    pass


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping, at any depth (PyYAML keeps the last value
    silently: a second `train:` section would replace the first). Merge keys (`<<: *base`) may be overridden."""

    def construct_document(self, node):
        self._dotted = {}
        _name_mappings(node, "", self._dotted)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for knode, _ in node.value:
            if knode.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(knode, deep=True)
            line = knode.start_mark.line + 1
            if key in seen:
                dotted = f"{self._dotted.get(id(node), '')}{key}"
                raise DuplicateKeyError(
                    None, None, f"duplicate key '{dotted}' (first at line {seen[key]})", knode.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def _name_mappings(node: Any, prefix: str, out: dict[int, str]) -> None:
    """id(mapping node) -> the dotted prefix of its keys ('train.'), for error messages."""
    if isinstance(node, yaml.MappingNode):
        out[id(node)] = prefix
        for knode, vnode in node.value:
            _name_mappings(vnode, f"{prefix}{knode.value}.", out)
    elif isinstance(node, yaml.SequenceNode):
        for i, vnode in enumerate(node.value):
            _name_mappings(vnode, f"{prefix}{i}.", out)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, with repeated keys an error (UniqueKeyLoader)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects


def _key_lines(text: str, node: Any = None, prefix: str = "") -> dict[str, int]:
    """1-based line of every dotted key in a YAML text, so errors can name file:line."""
    node = yaml.compose(text) if node is None else node
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            key = f"{prefix}{knode.value}"
            lines[key] = knode.start_mark.line + 1
            lines.update(_key_lines(text, vnode, key + "."))
    return lines


def _build(cls: type, data: dict, prefix: str, where: str, lines: dict[str, int] | None = None) -> Any:
    """Build a config dataclass from a mapping; `where` ('file: ') prefixes errors, and with `lines` (dotted
    key -> line) an error about a key from the file names file:line."""
    lines = lines or {}

    def at(key: str) -> str:
        return f"{where[:-2]}:{lines[key]}: " if where and key in lines else where

    if not isinstance(data, dict):
        raise ConfigError(f"{at(prefix.rstrip('.'))}'{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    valid = [prefix + n for n in fields]
    kwargs = {}
    for k, v in data.items():
        if k not in fields:
            raise _unknown(prefix + str(k), valid, at(prefix + str(k)))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v or {}, f"{prefix}{k}.", where, lines)
        else:
            try:
                kwargs[k] = _check_value(v, tp, prefix + k, dict(fields[k].metadata))
            except ConfigError as e:
                raise ConfigError(f"{at(prefix + k)}{e}") from None
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node: dict = tree
    for p in parts[:-1]:
        if node.get(p) is None:  # absent, or an empty section ('lora:' with nothing under it)
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: '{p}' is not a section")
    node[parts[-1]] = value


def _leaf_type(key: str) -> Any:
    cls: Any = Config
    for part in key.split("."):
        cls = _field_types(cls)[part]
    return cls


# The mappings of keyword arguments a plugin is built with (config/plugins.py): `KEY.NAME=value` sets one, any NAME.
ARGS_KEYS = ("task.args.", "loss.args.", "loss.correction_args.", "rollout.backend_args.")


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    valid = all_keys()
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' must look like section.key=value")
        key, raw = ov.split("=", 1)
        if key == "data.format":  # the old name of task.name (load_config, legacy_format)
            _drop_format(tree)
            key = "task.name"
        if any(key.startswith(a) and len(key) > len(a) for a in ARGS_KEYS):  # one argument of a plugin: any name
            _set_dotted(tree, key, _yaml_value(key, raw, str_field=False))
            continue
        if key not in valid:
            raise _unknown(key, valid, "command line: ")
        _set_dotted(tree, key, _yaml_value(key, raw, str_field=_leaf_type(key) is str))
    return tree


def _yaml_value(key: str, raw: str, str_field: bool) -> Any:
    """YAML parsing gives overrides the same typing as the file (3 -> int, 1e-4 -> float, [a,b] -> list);
    string fields take the text verbatim ('Q: {question}' must not become a YAML mapping)."""
    if str_field or raw == "":
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:  # '[q_proj' (unclosed list): PyYAML's message spans several lines
        raise ConfigError(
            f"command line: {key}={raw!r} is not a valid YAML value ({getattr(e, 'problem', None) or e})"
        ) from None


def _drop_format(tree: dict) -> None:
    data = tree.get("data")
    if isinstance(data, dict):
        data.pop("format", None)


def legacy_format(tree: dict, where: str) -> None:
    """data.format (configs and checkpoints written before tasks were plugins) read as task.name, in place; a
    file that sets both to different tasks is refused."""
    data = tree.get("data")
    if not isinstance(data, dict) or "format" not in data:
        return
    fmt = data.pop("format")
    task = tree.get("task")
    if task is None:
        task = tree["task"] = {}
    if not isinstance(task, dict):
        return  # _build says 'task' must be a mapping
    if "name" in task and task["name"] != fmt:
        raise ConfigError(
            f"{where}data.format={fmt!r} and task.name={task['name']!r} disagree; data.format is the old name of "
            "task.name: delete it"
        )
    task["name"] = fmt


MAIN_EVAL_METRIC = "eval/accuracy"  # ckpt.keep_best=auto: the in-loop eval's main metric


def parse_keep_best(value: str, eval_every: int) -> tuple[str, str]:
    """(metric, 'max' | 'min') from ckpt.keep_best; ('', '') when off. One-line ConfigError when malformed."""
    if value == "none" or (value == "auto" and not eval_every):
        return "", ""
    if value == "auto":
        return MAIN_EVAL_METRIC, "max"
    metric, _, mode = value.partition(":")
    mode = mode or "max"
    if not metric or "/" not in metric or mode not in ("max", "min"):
        raise ConfigError(
            f"ckpt.keep_best={value!r}: expected auto, none or <metric>[:max|:min] with a logged metric such as "
            "eval/accuracy or rollout/reward_mean:max"
        )
    if metric.startswith("eval/") and not eval_every:
        raise ConfigError(f"ckpt.keep_best={value!r} needs the in-loop eval: set eval.every > 0 (and data.eval)")
    return metric, mode


def check_run_name(name: str, where: str = "") -> None:
    """run.name is one directory under run.output_dir (and one prefix in the sync bucket): a single path
    component, so `../../x` or `/x` cannot write outside the output directory."""
    bad = (
        "is empty"
        if not name.strip()
        else "is '.' or '..'"
        if name in (".", "..")
        else "has a path separator"
        if "/" in name or "\\" in name
        else "has a NUL or control character"
        if any(ord(c) < 32 for c in name)
        else ""
    )
    if bad:
        raise ConfigError(f"{where}run.name={name!r} {bad}; it must be a single path component (a directory name)")


def load_config(
    path: str | os.PathLike | None,
    overrides: list[str] | None = None,
    required: Sequence[str] = (),
    training: bool = True,
) -> Config:
    """Load YAML (or defaults when path is None), apply `a.b=c` overrides, validate, return a Config.

    `required`: dotted keys the file itself must set (a saved config without its model is not all defaults).
    `training=False` skips the combinations refused only for training (evals read saved configs of runs made
    before a refusal existed; the policy they hold is evaluated the same way).
    """
    tree, lines = _read_file(path, required) if path is not None else ({}, {})
    where = f"{path}: " if path is not None else ""
    tree = apply_overrides(tree, overrides or [])
    task_splits(tree)
    for ov in overrides or []:  # an overridden value did not come from its line in the file
        lines.pop(ov.split("=", 1)[0], None)
    cfg = _build(Config, tree, "", where, lines)
    check_combinations(cfg, where, training)
    return cfg


def task_splits(tree: dict) -> None:
    """A task family that makes its own splits (GENERATED_SPLITS: reasoning-gym's) reads them when the config names
    no data: data.train / data.eval default to its 'task:train' / 'task:heldout' (data/sources.py), in place."""
    task, data = tree.get("task"), tree.get("data", {})
    name = task.get("name") if isinstance(task, dict) else None
    if not isinstance(name, str) or name.split("/")[0] not in GENERATED_SPLITS or not isinstance(data, dict):
        return  # a wrong type is named by _build
    tree["data"] = {"train": "task:train", "eval": "task:heldout", **data}


def _read_file(path: str | os.PathLike, required: Sequence[str]) -> tuple[dict, dict[str, int]]:
    """The file's tree of sections and each key's line; every way it can be unreadable is one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        tree = load_yaml(text)
        lines = _key_lines(text)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start]:#04x})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        if isinstance(e, DuplicateKeyError):
            raise ConfigError(f"{path}{line}: {e.problem}; PyYAML would silently keep the last one") from None
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if tree is None:  # an empty file (or one of comments) would silently train on every default
        raise ConfigError(f"{path}: the file is empty (no sections); it would silently train on every default")
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (run:, model:, ...), got a YAML {type(tree).__name__}"
        )
    legacy_format(tree, f"{path}: ")
    for key in required:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            raise ConfigError(f"{path}: no {key} (the file must set it; defaults are not assumed)")
    return tree, lines


def check_plugin_names(cfg: Config, where: str = "") -> None:
    """A built-in name an extension point does not have is one line at load (a user's 'file.py:NAME' is
    imported and checked where it is built, before any model loads: config/plugins.py)."""
    names = {
        "rollout.backend": ("backend", cfg.rollout.backend, ["auto", *BACKEND_NAMES]),
        "loss.type": ("objective", cfg.loss.type, list(OBJECTIVES)),
        "loss.correction": ("correction", cfg.loss.correction, ["none", *CORRECTIONS]),
    }
    for key, (noun, spec, builtin) in names.items():
        try:
            check_builtin(key, noun, spec, builtin)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None


def check_combinations(cfg: Config, where: str = "", training: bool = True) -> None:
    """Values each valid alone but wrong together (or wrong for training): one line naming both keys."""
    check_run_name(cfg.run.name, where)
    check_plugin_names(cfg, where)
    try:
        parse_keep_best(cfg.ckpt.keep_best, cfg.eval.every)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None
    if cfg.ckpt.resume not in ("none", "latest") and not Path(cfg.ckpt.resume).exists():
        raise ConfigError(f"{where}ckpt.resume={cfg.ckpt.resume!r}: no such checkpoint directory")
    if training:
        check_trainable_dtype(cfg)
        check_training_losses(cfg, where)
    check_async(cfg, where, training)
    t = cfg.train
    if training and t.pack_sequences and cfg.model.attn_implementation == "flash_attention_2" and t.pack_row_tokens:
        raise ConfigError(
            f"{where}train.pack_row_tokens={t.pack_row_tokens} with model.attn_implementation=flash_attention_2: "
            "flash-attention packs each micro-batch into one row (its varlen path reads the sequence boundaries "
            "only in a batch of one row); leave train.pack_row_tokens at 0"
        )
    if cfg.rollout.min_new_tokens > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"{where}rollout.min_new_tokens={cfg.rollout.min_new_tokens} > rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}: no completion could end"
        )
    bad_url = [u for u in cfg.server.urls if not re.fullmatch(r"https?://[^/\s]+/?", u)]
    if bad_url:
        raise ConfigError(f"{where}server.urls: {bad_url[0]!r} is not a base URL like 'http://host:8000'")
    if training and cfg.run.dist_timeout_s <= cfg.sync.final_timeout_s:
        raise ConfigError(
            f"{where}run.dist_timeout_s={cfg.run.dist_timeout_s:g} <= sync.final_timeout_s="
            f"{cfg.sync.final_timeout_s:g}: the other ranks wait at the final barrier while rank 0 uploads, and "
            "their collective would time out first; raise run.dist_timeout_s"
        )
    bad_k = [k for k in cfg.eval.ks if not 1 <= k <= cfg.eval.num_samples]
    if bad_k:
        raise ConfigError(
            f"{where}eval.ks={cfg.eval.ks}: k={bad_k[0]} is outside 1..eval.num_samples={cfg.eval.num_samples} "
            "(pass@k and maj@k need n >= k samples per problem)"
        )
    check_sync_target(cfg.sync.remote, cfg.sync.bucket, cfg.sync.path, where)
    check_multiturn(cfg, where)


def check_training_losses(cfg: Config, where: str = "") -> None:
    if cfg.probe.advisor and not cfg.probe.enabled:
        raise ConfigError(f"{where}probe.advisor=true with probe.enabled=false: the advisor is a probe; enable both")
    if cfg.probe.advisor and cfg.model.gradient_checkpointing:
        raise ConfigError(
            f"{where}probe.advisor=true with model.gradient_checkpointing=true: the advisor reads the unit level's "
            "per-sequence capture, which a recompute would fire twice; set one of them off"
        )
    if cfg.train.drop_zero_adv_groups is True and cfg.loss.kl_coef > 0:
        raise ConfigError(
            f"{where}train.drop_zero_adv_groups=true with loss.kl_coef={cfg.loss.kl_coef}: a zero-advantage "
            "group still has a KL gradient, which dropping it would silently remove; set one of them off"
        )
    correction, _ = cfg.loss.correction_spec()
    if correction != "none" and cfg.rollout.top_p < 1:
        raise ConfigError(
            f"{where}loss.correction={correction} with rollout.top_p={cfg.rollout.top_p}: the sampler's "
            "log-probs come from the top-p renormalised distribution, so pi_train/pi_rollout would not be an "
            "importance ratio; set rollout.top_p=1 or loss.correction=none"
        )


def check_multiturn(cfg: Config, where: str = "") -> None:
    m = cfg.multiturn
    if m.max_tokens_per_turn > m.max_response_tokens:
        raise ConfigError(
            f"{where}multiturn.max_tokens_per_turn={m.max_tokens_per_turn} > multiturn.max_response_tokens="
            f"{m.max_response_tokens}: one turn could never use its cap"
        )
    if any(not s for s in m.stop):
        raise ConfigError(f"{where}multiturn.stop={m.stop}: an empty stop string would end every turn at once")


def check_async(cfg: Config, where: str = "", training: bool = True) -> None:
    """rollout.max_async_level > 0 only where the staleness is corrected (rl_training/rollout/async_queue.py);
    whether the backend can run ahead is its own rule (rollout/kinds.py)."""
    k = cfg.rollout.max_async_level
    if not training or k == 0:
        return
    head = f"{where}rollout.max_async_level={k}"
    if cfg.loss.correction_spec()[0] == "none":
        raise ConfigError(
            f"{head} with loss.correction=none: batches come from a policy up to {k} steps old, and only an "
            "off-policy correction accounts for that (decoupled PPO); set loss.tis_cap (e.g. 2.0) or loss.correction"
        )


_REMOTE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


_UNSAFE_PATH_CHARS = set('"$`\\:,\n\r')  # rclone-python builds a shell command line in double quotes


def check_sync_target(remote: str, bucket: str, path: str, where: str = "") -> None:
    """The upload destination must be a plain remote name and plain path segments: nothing that rclone could
    read as inline credentials (':s3,secret_access_key=...:') or a shell could expand. Values are not echoed."""
    if remote and not _REMOTE_NAME.fullmatch(remote):
        raise ConfigError(
            f"{where}sync.remote must be the name of an rclone remote (letters, digits, '_', '-', '.'); "
            "configure the remote and its credentials with RCLONE_CONFIG_<NAME>_* environment variables"
        )
    for key, value in (("bucket", bucket), ("path", path)):
        if _UNSAFE_PATH_CHARS & set(value):
            raise ConfigError(f'{where}sync.{key} may not contain any of " $ ` \\ : , or a newline')


def check_trainable_dtype(cfg: Config) -> None:
    """The RL and SFT runners train without a GradScaler, so float16 gradients would underflow: refuse it
    (load_config with training=True; evals load with training=False and may run in float16)."""
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16 cannot train: there is no fp16 gradient scaler (small gradients underflow "
            "to 0); use bfloat16 or float32"
        )


def to_dict(cfg: Config, redact: bool = True) -> dict:
    """Plain dict of the config; fields marked secret are replaced by '***'."""
    out = dataclasses.asdict(cfg)
    if redact:
        for section in dataclasses.fields(cfg):
            for f in dataclasses.fields(getattr(cfg, section.name)):
                if f.metadata.get("secret") and out[section.name][f.name]:
                    out[section.name][f.name] = "***"
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
