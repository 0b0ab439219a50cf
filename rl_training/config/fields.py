"""What every config section is made of: a field with its default, its one-line doc and bounds (`_f`, checked at
load by rl_training/config/load.py), and the error a bad value raises. A leaf of the config package."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from rl_training.base.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad config value; the message names the file and the dotted key."""


def _f(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    secret: bool = False,
) -> Any:
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "secret": secret}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)
