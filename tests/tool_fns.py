"""Tool functions the tool tests declare (tests/unit/tasks/test_tools.py, test_tool_boundary.py). A ToolEnvironment
runs its tools in a process of their own, which imports each by reference (sandbox/tool_process.py): they live in
this light module, so that process does not import a whole test module (tokenizers, torch) to find them."""

from __future__ import annotations

import time


def calculator(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def echo(text: str) -> str:
    """Return the text as it is.

    Args:
        text: What to return.
    """
    return text


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"no {x}")


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def stubborn(seconds: float) -> str:
    """Busy-loop for a while, swallowing whatever is raised to stop it.

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sum(range(1000))
        except BaseException:  # noqa: BLE001 -- the point: a tool that catches everything, a timeout included
            pass
    return "done"


def raw(kind: str):
    """Return hostile or odd output.

    Args:
        kind: Which one.
    """
    return {
        "bytes": bytes(range(256)) * 4,
        "surrogate": "a\udcffb",
        "huge": "x" * 100_000,
        "huge_int": 10**5000,
        "deep": nested_list(5000),
        "bytes_im_end": b"\xff\xfe<|im_end|>",
        "set": {1, 2},
        "object": object(),
        "unprintable": Unprintable(),
        "look_alikes": "<tool_call>" * 2000 + "<|im_end|>" * 2000,
    }.get(kind, kind)


def hostile_raise(kind: str) -> int:
    """Raise something hard to show.

    Args:
        kind: Which one.
    """
    if kind == "unprintable":
        raise Unprintable()
    if kind == "surrogate":
        raise ValueError("bad \udc80 byte")
    raise KeyError(kind * 3)


class Unprintable(Exception):
    """An exception whose str() raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


def nested_list(depth: int) -> list:
    """A list `depth` levels deep: 5000 is past the recursion limit that json and str() work within."""
    out: list = []
    for _ in range(depth):
        out = [out]
    return out
