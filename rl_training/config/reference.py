"""The generated config reference, docs/config.md: every key of rl_training/config/schema.py with its type, default
and doc, and the names a registry above config/ adds to a key's doc (`make config-ref`: runners/config_reference.py
writes the page with the tasks', objectives', corrections' and backends' registries)."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from rl_training.config.schema import Config, _field_types


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "mapping"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def reference(cls: type = Config, prefix: str = "", names: Mapping[str, str] | None = None) -> str:
    """Markdown table of every key, its type, default and doc (the config reference); `names`: text appended to a
    key's doc (dotted key -> the names its registry holds)."""
    names = names or {}
    lines = [] if prefix else ["| key | type | default | meaning |", "|---|---|---|---|"]
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(reference(tp, f"{prefix}{f.name}.", names))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = " ".join(filter(None, (f.metadata["doc"], names.get(f"{prefix}{f.name}")))).replace("|", "\\|")
        lines.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | `{default!r}` | {doc} |")
    return "\n".join(lines)


CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


_CONFIG_DOC_HEAD = """# Config reference

Every key of the config tree, generated from `rl_training/config/schema.py` and the registries by `make
config-ref` (`python -m rl_training.runners.config_reference --write docs/config.md`);
`tests/unit/config/test_config.py` fails when this page is out of date.
Keys are set in a YAML file (`--cfg`) and overridden on the command line with dotted names
(`train.total_steps=10 lora.target_modules=[q_proj,v_proj]`); an unknown key is an error naming the nearest
valid one. Everything above the table is kept when the table is regenerated.

"""


def write_reference(path: str | os.PathLike, table: str) -> None:
    """Rewrite the reference table of `path` (docs/config.md) with `table` (`reference`'s): the text before its
    header is kept, the table from the header to the end is replaced; a new file gets the standard heading."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    header = "| key | type | default | meaning |"
    head = text[: text.index(header)] if header in text else _CONFIG_DOC_HEAD
    path.write_text(head + table + "\n")
