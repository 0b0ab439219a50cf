"""The program a completion stands for: its last fenced python block, or, for a HumanEval-style prompt that
ends inside a function, the continuation of that function."""

from __future__ import annotations

import re

# ```python / ```py / ```python3 / a bare ``` fence, closed by ``` at the start of a line. The blanks after a bare
# fence are one run ('[ \t]*(?:python3?|py)?[ \t]*' split a long blank run every way: 2 s on 40,000 tabs).
_FENCE = re.compile(r"^[ \t]*```[ \t]*(?:(?:python3?|py)[ \t]*)?\n(.*?)^[ \t]*```", re.M | re.S | re.I)
_OPEN_FENCE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*\n(.*)\Z", re.M | re.S | re.I)
# Top-level lines a function continuation may contain; any other column-0 line ends it (a `print(...)`,
# `if __name__ == ...`, a closing fence or prose), as the HumanEval stop sequences do.
_TOP_LEVEL_OK = re.compile(r"(def |async def |class |import |from |@|#)")


def last_fenced_block(text: str) -> str | None:
    """The last closed fenced code block; else a final ```python block the generation cut off; else None."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    m = _OPEN_FENCE.search(text)
    return m.group(1) if m else None


def function_continuation(completion: str, mid_line: bool = False) -> str:
    """The completion up to its first column-0 line that cannot belong to the program. With mid_line (the
    prompt ends inside a line, e.g. at `return `), the first line finishes the prompt's line and is kept."""
    lines = completion.split("\n")
    out = lines[:1] if mid_line else []
    for line in lines[len(out) :]:
        if line and not line[0].isspace() and not _TOP_LEVEL_OK.match(line):
            break
        out.append(line)
    return "\n".join(out)


def program_for(completion: str, prompt: str = "", entry_point: str = "") -> str:
    """The code to run. With a prompt (HumanEval style) and no fence: prompt + continuation. A fenced block
    that defines the entry point follows the prompt (which may hold helpers and imports the block uses);
    any other fenced block, or a completion without a fence, is the program itself."""
    block = last_fenced_block(completion)
    if prompt:
        if block is None:
            return prompt + function_continuation(completion, mid_line=not prompt.endswith("\n"))
        return f"{prompt}\n    pass\n\n{block}" if f"def {entry_point}" in block else f"{prompt}\n    pass\n"
    return completion if block is None else block


def has_code(completion: str) -> bool:
    """Format check: a fenced block, or any non-blank text (a bare continuation)."""
    return bool(completion.strip())
