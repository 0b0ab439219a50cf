"""Loading the config tree: YAML (repeated keys refused), dotted command-line overrides, per-field type and
bounds checks (the bounds are declared with each field in rl_training/config/schema.py), the combinations refused at
load, and the YAML a run saves. Unknown keys are errors naming the key and the nearest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from rl_training.config.rules import check_combinations
from rl_training.config.schema import Config, ConfigError, _field_types, all_keys


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
    for ov in overrides or []:  # an overridden value did not come from its line in the file
        lines.pop(ov.split("=", 1)[0], None)
    cfg = _build(Config, tree, "", where, lines)
    check_combinations(cfg, where, training)
    return cfg


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
