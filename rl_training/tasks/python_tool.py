"""The `python` tool environment: tool-integrated math reasoning (ToRL, ReTool, SimpleTIR) on the chat-template
tool protocol (tools.py), the model's code run in a sandbox pool of its own (rl_training/sandbox/), the final
answer graded by the math grader (tasks/math.py). docs/tools.md, "The python tool", has the protocol, the
metrics, the limits and the persistence choice.

Persistence (persist=True, the default): variables, functions and imports of an episode's earlier calls are there
in its later ones, as in a notebook. There is no long-lived interpreter: every call runs in a fresh sandboxed
candidate that first replays the episode's earlier successful cells (their output discarded), then runs the new
one. Holding a candidate open for a whole episode would hold a pool worker across generation turns (a batch has
far more episodes than workers); with replay an episode's state is its list of cells, so each call runs in a
sandbox started for it alone (PoolSettings.fresh), where a reused worker would keep some of what an earlier
episode's program left. The cost is re-running earlier cells within the call's time limit (a cell that raised is
not replayed; one that draws random numbers without a seed draws again) and a sandbox start per call. docs/tools.md
("Isolation") says what a call can and cannot pass on, and what every sandbox of a node still shares.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from rl_training.config.schema import SandboxCfg
from rl_training.data.sources import Example
from rl_training.sandbox import worker
from rl_training.sandbox.confinement import PoolSettings
from rl_training.sandbox.handle import Job, JobTimeout
from rl_training.sandbox.pool import Pool
from rl_training.tasks.base import TaskContext, Turn
from rl_training.tasks.math import MathTask, math_answer_classes, math_has_answer, math_reward
from rl_training.tasks.tools import (
    ERROR_CLASSES,
    ToolCall,
    ToolEnvironment,
    ToolEpisode,
    ToolFailed,
    ToolStats,
    final_text,
    scan_tool_calls,
)

NO_OUTPUT = "(no output)"


def python(code: str) -> str:
    """Run Python code in a sandboxed interpreter and return what it printed (stdout and stderr, with the traceback
    of an uncaught exception). There is no network and no file outside /tmp; print() the values you need.

    Args:
        code: The Python program to run.
    """
    raise RuntimeError("the python tool runs through PythonToolEnvironment.invoke")


PERSIST_NOTE = " Variables, functions and imports of your earlier successful calls are kept."

# Runs inside the sandbox as the candidate's __main__ (worker.py's stdio protocol: its stdout is the reply). The
# cells run in a namespace of their own; what they print goes to a sink that keeps, of the last cell only, its
# first CAP - CAP // 2 and last CAP // 2 characters; the one thing written to the real stdout is a JSON summary.
_RUNNER = r"""
import json, sys, traceback
_cells, _cap, _real = json.loads(CELLS), CAP, sys.stdout

class _Sink:
    def __init__(self, keep):
        self.head, self.tail, self.n, self.keep = [], "", 0, keep
    def write(self, s):
        s = str(s)
        if self.keep:
            room = max(_cap - _cap // 2 - self.n, 0)
            self.head.append(s[:room])
            self.tail = (self.tail + s[room:])[-(_cap // 2):] if _cap // 2 else ""
        self.n += len(s)
        return len(s)
    def flush(self):
        pass
    def isatty(self):
        return False

_ns = {"__name__": "__main__", "__builtins__": __builtins__}
for _i, _src in enumerate(_cells):
    _sink = _Sink(_i == len(_cells) - 1)
    sys.stdout = sys.stderr = _sink
    _ok, _memory = True, False
    try:
        exec(compile(_src, "<cell %d>" % (_i + 1), "exec"), _ns)
    except SystemExit as _e:
        if _e.code not in (None, 0):
            _ok = False
            _sink.write("SystemExit: %s\n" % (_e.code,))
    except BaseException as _e:
        _ok = False
        _memory = isinstance(_e, MemoryError)
        try:
            _tb = _e.__traceback__.tb_next if _e.__traceback__ is not None else None
            _sink.write("".join(traceback.format_exception(type(_e), _e, _tb)))
        except BaseException:
            _sink.write("%s\n" % type(_e).__name__)
_res = {"ok": _ok, "memory": _memory, "head": "".join(_sink.head), "tail": _sink.tail, "chars": _sink.n}
sys.stdout = sys.stderr = _real
_real.write(json.dumps(_res))
"""


def runner_source(cells: list[str], cap: int) -> str:
    """The candidate program that replays `cells[:-1]` silently and runs `cells[-1]` (the module's _RUNNER)."""
    return _RUNNER.replace("CAP", str(int(cap)), 1).replace("CELLS", repr(json.dumps(cells)), 1)


@dataclass
class PythonEpisode(ToolEpisode):
    cells: list[str] = field(default_factory=list)  # the episode's successful cells, replayed before a new one
    ready: dict[int, tuple[str, str]] = field(default_factory=dict)  # nth call -> its result, run ahead in parallel


class PythonToolEnvironment(ToolEnvironment):
    """GSM8K or MATH records ({question_key, answer_key}, as MathTask reads them) answered with a `python` tool;
    the final text (after the last tool call) is graded by `math_reward`. Error classes beyond the protocol's:
    `memory` (the program ran out of memory) and `crash` (its process ended without a reply); an uncaught
    exception is `raised` with its traceback as the result."""

    reward_range = (0.0, 1.0)
    tools = (python,)
    error_classes = (*ERROR_CLASSES, "memory")

    def __init__(
        self,
        fmt: Literal["gsm8k", "math"] = "math",
        question_key: str = "question",
        answer_key: str = "answer",
        max_tool_calls: int = 4,
        tool_timeout_s: float = 5.0,
        output_chars: int = 1024,
        persist: bool = True,
        max_obs_tokens: int | None = None,
        empty_results: bool = False,
    ):
        super().__init__(max_tool_calls, tool_timeout_s, max_obs_tokens, empty_results=empty_results)
        if output_chars < 1:
            raise ValueError(f"output_chars must be >= 1, got {output_chars}")
        self.math = MathTask(fmt, question_key, answer_key)
        self.question_key, self.answer_key = question_key, answer_key
        self.output_chars, self.persist = output_chars, persist
        if persist:  # the model is told, in the tool's description, that state carries over
            self.schemas[0]["function"]["description"] += PERSIST_NOTE
        self.pool: Pool | None = None

    # ------------------------------------------------------------------------------------------- resources
    def start(self, ctx: TaskContext | None = None) -> None:
        """The template check (ToolEnvironment.start), then this environment's sandbox pool with the run's sandbox.*
        (SandboxUnavailable says why a node cannot run it)."""
        ctx = ctx or TaskContext()
        super().start(ctx)
        s = getattr(ctx.cfg, "sandbox", None) or SandboxCfg()
        # fresh: every call gets a sandbox of its own. The episodes of a group share a prompt, so anything one call
        # left in a reused worker (a locked directory, /tmp's mode or times, the template's rlimits, the pid counter)
        # could carry an answer to another episode; the cost is a sandbox start per call (docs/tools.md).
        self.close()  # a second start replaces the pool
        self.pool = Pool(PoolSettings.from_cfg(s, ranks_per_node=ctx.local_world_size, fresh=True))
        if ctx.rank == 0:
            print(f"python tool sandbox protections: {self.pool.protections.summary()}", flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # -------------------------------------------------------------------------------------------- grading
    def parse(self, record: dict, where: str) -> Example:
        return self.math.parse(record, where)

    def reward(self, completion: str, example: Example) -> float:
        return math_reward(final_text(completion), example.reference)

    def has_answer(self, completion: str) -> bool:
        return math_has_answer(final_text(completion))

    def answer_classes(self, completions, timeout_s: float = 5.0) -> list[int | None]:
        return math_answer_classes([final_text(c) for c in completions], timeout_s)

    # ------------------------------------------------------------------------------------------- episodes
    def reset(self, example: Example) -> PythonEpisode:
        return PythonEpisode(example)

    def step_batch(self, states: list, turns: list[Turn], stats: ToolStats) -> list:
        """The calls of different episodes run in parallel over the pool (an episode's own in order: each may
        replay the one before), then the turns are answered as ToolEnvironment answers them."""
        todo = [
            (ep, calls)
            for ep, t in zip(states, turns, strict=True)
            if not t.exhausted and (calls := scan_tool_calls(t.text, self.turn_limit(ep))[0])
        ]
        if todo and self.pool is None:
            raise RuntimeError("PythonToolEnvironment.step_batch before start(): no sandbox pool")
        if todo:
            with ThreadPoolExecutor(min(self.pool.size, len(todo)), thread_name_prefix="python-tool") as ex:
                list(ex.map(lambda a: self._run_ahead(*a), todo))
        return super().step_batch(states, turns, stats)

    def _run_ahead(self, ep: PythonEpisode, calls: list[ToolCall]) -> None:
        for nth, c in enumerate(calls, start=ep.calls + 1):
            ep.ready[nth] = ToolEnvironment.call(self, c, nth, ep)

    def call(self, call: ToolCall, nth: int, ep: ToolEpisode | None = None) -> tuple[str, str]:
        if isinstance(ep, PythonEpisode) and nth in ep.ready:
            return ep.ready.pop(nth)
        return super().call(call, nth, ep)

    def invoke(self, ep: ToolEpisode | None, fn, arguments: dict) -> str:
        """Run `code` after the episode's earlier successful cells in a fresh candidate (module docstring)."""
        if self.pool is None:
            raise RuntimeError("PythonToolEnvironment.invoke before start(): no sandbox pool")
        code = arguments["code"]
        cells = [*ep.cells, code] if self.persist and isinstance(ep, PythonEpisode) else [code]
        res = self.run_cells(cells)
        if res["ok"] and self.persist and isinstance(ep, PythonEpisode):
            ep.cells.append(code)
        text = self._shown(res)
        if res["memory"]:
            mib = self.pool.settings.limits.mem_bytes >> 20
            raise ToolFailed("memory", f"{text.rstrip()}\nerror: python ran out of memory (limit {mib} MiB)")
        if not res["ok"]:
            raise ToolFailed("raised", text)
        return text

    def run_cells(self, cells: list[str]) -> dict:
        """{"ok", "memory", "head", "tail", "chars"} of the last cell, or ToolFailed for a timeout or a crash."""
        src = runner_source(cells, self.output_chars)
        ran = self.pool.run(lambda job: _drive(job, src), self.tool_timeout_s)
        status = ran.status
        if ran.result == "timeout" or (
            status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU
        ):
            raise ToolFailed("timeout", f"error: python timed out after {self.tool_timeout_s:g} s")
        res = ran.result if ran.clean else None
        if not isinstance(res, dict):
            how = ""
            if status is not None and os.WIFSIGNALED(status):
                how = f" (killed by signal {os.WTERMSIG(status)})"
            elif status is not None and os.WIFEXITED(status):
                how = f" (exit status {os.WEXITSTATUS(status)})"
            raise ToolFailed("crash", f"error: python crashed: its process ended without a reply{how}")
        return res

    def _shown(self, res: dict) -> str:
        """The cell's output as the result, NO_OUTPUT when it printed nothing; past output_chars its first and last
        halves around a marker (a traceback's last line, the error, stays)."""
        n, t = res["chars"], self.output_chars // 2
        head, tail = res["head"][: self.output_chars - t], res["tail"][-t:] if t else ""
        if n <= len(head) + len(tail):
            return head + tail or NO_OUTPUT
        return f"{head}\n[output truncated: {n - len(head) - len(tail)} of {n} characters cut]\n{tail}"


def _drive(job: Job, src: str) -> dict | str | None:
    """The trusted end: send the runner, ask it to run once, read its JSON summary (a dict with the expected
    fields), "timeout", or None when the candidate ended or answered something else."""
    try:
        if "ok" not in job.ask({"code": src, "name": "__main__", "setup": ""}):
            return None
        reply = job.ask({"stdin": ""})
    except JobTimeout:
        return "timeout"
    except worker.ProtocolError:
        return None
    try:
        res = json.loads(reply.get("stdout") or "")
    except (TypeError, ValueError, RecursionError):
        return None
    keys = {"ok": bool, "memory": bool, "head": str, "tail": str, "chars": int}
    if not isinstance(res, dict) or not all(isinstance(res.get(k), t) for k, t in keys.items()):
        return None
    return res
