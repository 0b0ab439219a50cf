"""The generated config reference, docs/config.md: every key of rl_training/config/schema.py with its type, default
and doc. `make config-ref` (`python -m rl_training.config.reference --write docs/config.md`) rewrites its table."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Literal

from rl_training.config.schema import Config, _field_types


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "mapping"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def reference(cls: type = Config, prefix: str = "") -> str:
    """Markdown table of every key, its type, default and doc (the config reference)."""
    lines = [] if prefix else ["| key | type | default | meaning |", "|---|---|---|---|"]
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(reference(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = f.metadata["doc"].replace("|", "\\|")
        lines.append(f"| `{prefix}{f.name}` | {_type_name(tp)} | `{default!r}` | {doc} |")
    return "\n".join(lines)


CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


_CONFIG_DOC_HEAD = """# Config reference

Every key of the config tree, generated from `rl_training/config/schema.py` by `make config-ref` (`python -m
rl_training.config.reference --write docs/config.md`); `tests/unit/config/test_config.py` fails when this page is
out of date.
Keys are set in a YAML file (`--cfg`) and overridden on the command line with dotted names
(`train.total_steps=10 lora.target_modules=[q_proj,v_proj]`); an unknown key is an error naming the nearest
valid one. Everything above the table is kept when the table is regenerated.

"""


def write_reference(path: str | os.PathLike = CONFIG_DOC) -> None:
    """Rewrite the reference table of `path` (docs/config.md): the text before its header is kept, the table
    from the header to the end is replaced; a new file gets the standard heading."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    header = "| key | type | default | meaning |"
    head = text[: text.index(header)] if header in text else _CONFIG_DOC_HEAD
    path.write_text(head + reference() + "\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        write_reference(sys.argv[2] if len(sys.argv) > 2 else CONFIG_DOC)
    else:
        print(reference())
