"""The child side of ToolProcess (tool_process.py): imports the tools, then answers one call at a time with the
tool's return value rendered to text (data.text.result_text), so only strings cross back and nothing a tool
returns or raises can kill this loop. Started only by ToolProcess (its boot line), never imported by the parent.

Every message from here is a tuple of strings: ("ready",), ("error", one line) when a tool cannot be imported,
("reply", text, error class or "").
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from rl_training.base.errors import one_line
from rl_training.config.plugins import module_from_file
from rl_training.data.text import result_text
from rl_training.sandbox.tool_process import ToolFailed
from rl_training.sandbox.worker import ChannelClosed, recv_frame, send_frame


def main(sock_fd: int, lifeline_fd: int) -> None:
    _watch_parent(lifeline_fd)
    sock = socket.socket(fileno=sock_fd)
    config = pickle.loads(recv_frame(sock))
    try:
        tools = {ref[0]: import_tool(*ref) for ref in config["tools"]}
    except ImportError as e:
        send_frame(sock, pickle.dumps(("error", str(e))))
        return
    send_frame(sock, pickle.dumps(("ready",)))
    while True:
        try:
            name, arguments = pickle.loads(recv_frame(sock))
        except ChannelClosed:  # the parent closed: nothing more to do
            return
        text, cls = run_tool(tools[name], name, arguments)
        send_frame(sock, pickle.dumps(("reply", text, cls), protocol=pickle.HIGHEST_PROTOCOL))


def _watch_parent(lifeline_fd: int) -> None:
    """Kill this process group when the parent is gone (its end of the lifeline pipe closed), even in the middle
    of a tool call: no tool process outlives the trainer."""

    def watch():
        while os.read(lifeline_fd, 1):
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="tool-lifeline", daemon=True).start()


# ----------------------------------------------------------------------------------------------- importing
def import_tool(name: str, module: str, qualname: str, file: str) -> Callable:
    """The function `module`.`qualname`; a module that does not import by name is loaded from `file` under the
    same name (a user's task file, config.plugins.import_file); __main__ is loaded as __mp_main__, so its
    `if __name__ == "__main__"` block does not run. ImportError (one line) for anything that fails."""
    try:
        mod = _load(module, file)
        obj: Any = mod
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except BaseException as e:  # noqa: BLE001 -- whatever the module raises at import (SystemExit too) is one line
        where = f" from {file}" if file else ""
        raise ImportError(f"tool {name!r}: importing {module}.{qualname}{where} raised {safe_line(e)}") from None
    return obj


def _load(module: str, file: str):
    if module == "__main__":
        return module_from_file("__mp_main__", file)
    if module in sys.modules:
        return sys.modules[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not file or e.name != module:
            raise
    return module_from_file(module, file)


# ------------------------------------------------------------------------------------------------- calling
def run_tool(fn: Callable, name: str, arguments: dict) -> tuple[str, str]:
    """(text, error class) of fn(**arguments): its return value rendered, ToolFailed's own text and class, or
    any other exception as a 'raised' line."""
    try:
        out = fn(**arguments)
    except ToolFailed as e:
        return safe_str(e.text), safe_str(e.cls)
    except BaseException as e:  # noqa: BLE001 -- a tool may raise anything (SystemExit too): an observation
        return f"error: {name} raised {safe_line(e)}", "raised"
    try:
        text = result_text(out)
        if type(text) is not str:
            raise TypeError(f"result_text returned a {type(text).__name__}")
    except BaseException:  # noqa: BLE001 -- an unrenderable value (a RecursionError, an int past the str limit)
        return f"<unrenderable {type_name(out)}>", ""
    return text, ""


def type_name(x: object) -> str:
    try:
        return str(type(x).__name__)
    except BaseException:  # noqa: BLE001 -- a metaclass whose __name__ raises
        return "object"


def safe_line(e: BaseException) -> str:
    """one_line(e), or the exception's type name when its __str__ (or __repr__) raises."""
    try:
        return one_line(e)
    except BaseException:  # noqa: BLE001 -- the exception's own __str__ may raise anything
        return type_name(e)


def safe_str(x: object) -> str:
    """x if it is a str, else str(x), else its type name (what ToolFailed carries is a user's value)."""
    if type(x) is str:
        return x
    if isinstance(x, str):  # a subclass would need its class to unpickle: the parent loads plain strings only
        return str.__str__(x)
    try:
        return str(x).encode("utf-8", errors="replace").decode("utf-8")
    except BaseException:  # noqa: BLE001 -- a value whose __str__ raises
        return f"<{type_name(x)}>"
