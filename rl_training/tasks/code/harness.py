"""The trusted side: tests run here, against a candidate that lives in the sandbox and answers with plain values.

A function-call test (HumanEval's `check(candidate)`, an MBPP assert) runs in this process, which never
runs model-written code. Every name the test uses that trusted code does not define (the entry point, or
`candidate` for HumanEval) is a `_Remote` proxy: calling it sends the arguments to the candidate and gets
back the result decoded into builtin types (worker.decode), so the asserts compare real ints, lists and
strings: an always-equal object, a patched `assert`, a forged result list or an exit code cannot reach
them. A stdin/stdout test sends the input and compares the returned text here. A pass needs every test
unit to pass, at least one answer from the candidate, and the worker's confirmation that every process of
the job was killed (sandbox.Ran.clean).

Test code, the prompt's helper functions (HumanEval/32's `poly`, /38's `encode_cyclic`) and MBPP's
test_setup_code are trusted data: they run here, compiled with asserts kept whatever `python -O` says, under
a line tracer that stops them at the program's deadline (a loop driven by a returned value cannot hang the
trainer).
"""

from __future__ import annotations

import builtins
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from rl_training.sandbox import worker
from rl_training.sandbox.handle import Job, JobTimeout
from rl_training.sandbox.pool import Pool
from rl_training.tasks.code import FAILURE_CLASSES  # classes most severe first: a program gets its worst


@dataclass(frozen=True)
class Program:
    """One program and its tests. kind='call': `tests` are trusted source units (one assert, or
    'check(candidate)'); kind='stdio': `cases` are (stdin, expected stdout) pairs."""

    code: str
    kind: Literal["call", "stdio"]
    tests: tuple[str, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()
    trusted_setup: str = ""  # run in the trusted test namespace (HumanEval prompt + test, MBPP setup)
    candidate_setup: str = ""  # run before the candidate's code in the sandbox (MBPP test_setup_code)
    entry_point: str = ""  # `candidate` in the tests calls this function
    float_tol: float = 0.0  # stdio: numeric tokens equal within this absolute or relative tolerance


@dataclass(frozen=True)
class Verdict:
    passed: bool
    fraction: float  # test units passed / units
    failure: str | None  # one of FAILURE_CLASSES, None when passed


class _Fatal(Exception):
    """The candidate can no longer answer (timeout, gone, oversized or malformed reply): sticky for the job."""

    def __init__(self, cls: str):
        super().__init__(cls)
        self.cls = cls


class CandidateRaised(Exception):
    """The candidate's function raised; the test sees this (and may catch it, as in the original harness)."""


class _Session:
    def __init__(self, job: Job):
        self.job, self.fatal, self.answers = job, None, 0

    def ask(self, msg: dict) -> dict:
        if self.fatal is not None:
            raise _Fatal(self.fatal)
        try:
            reply = self.job.ask(msg)
        except JobTimeout:
            self.fatal = "timeout"
        except worker.ProtocolError as e:
            self.fatal = "memory" if "cap" in str(e) else "runtime_error"
        else:
            self.answers += 1
            return reply
        raise _Fatal(self.fatal)


class _Remote:
    """Stands for a function of the candidate; returns decoded builtin values only."""

    def __init__(self, session: _Session, name: str):
        self._s, self._name = session, name

    def __call__(self, *args, **kwargs):
        try:
            msg = {"call": self._name, "args": worker.encode(list(args)), "kwargs": worker.encode(kwargs)}
        except TypeError as e:  # a test passing a lambda or an object: cannot cross, the unit fails
            raise CandidateRaised(f"argument not transferable: {e}") from None
        reply = self._s.ask(msg)
        if "value" in reply:
            try:
                return worker.decode(reply["value"])
            except (ValueError, TypeError, RecursionError):
                self._s.fatal = "runtime_error"
                raise _Fatal("runtime_error") from None
        name = reply.get("raise")
        raise CandidateRaised(name if isinstance(name, str) else "unencodable")


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _global_names(c)
    return names


@functools.lru_cache(maxsize=4096)  # a step's batch repeats each problem's tests group_size times
def _compile(src: str, name: str):
    return compile(src, name, "exec", dont_inherit=True, optimize=0)  # asserts kept under python -O


class _Deadline:
    """A line tracer for trusted test code: past the job's deadline the job is marked timed out (sticky, so
    a test's own `except Exception` cannot hide it) and JobTimeout is raised."""

    def __init__(self, session: _Session):
        self.s, self.n = session, 0

    def __call__(self, frame, event, arg):
        self.n += 1
        if self.n % 64 == 0 and time.monotonic() > self.s.job.deadline:
            self.s.fatal = "timeout"
            raise JobTimeout
        return self


def _run_unit(compiled, ns: dict, s: _Session) -> str | None:
    """One test unit; None if it passed, else its failure class."""
    sys.settrace(_Deadline(s))
    try:
        exec(compiled, ns)
    except _Fatal as e:
        return e.cls
    except JobTimeout:
        s.fatal = "timeout"
        return "timeout"
    except CandidateRaised as e:
        return "memory" if str(e) == "MemoryError" else "runtime_error"
    except (Exception, SystemExit):  # noqa: BLE001 -- the trusted test failed on the candidate's answer
        return "wrong_answer"
    finally:
        sys.settrace(None)
    return s.fatal


def _load(s: _Session, p: Program, name: str) -> str | None:
    """Send the program; None when it compiled and its top level ran, else its failure class."""
    try:
        first = s.ask({"code": p.code, "name": name, "setup": p.candidate_setup})
    except _Fatal as e:
        return e.cls
    if "ok" in first:
        return None
    err = first.get("error")
    return err if err in FAILURE_CLASSES else "runtime_error"


def _drive_call(p: Program, job: Job) -> tuple[list[str | None], int]:
    s = _Session(job)
    err = _load(s, p, "candidate")
    if err:
        return [err] * len(p.tests), s.answers
    ns: dict = {"__builtins__": builtins, "__name__": "tests"}
    try:
        exec(_compile(p.trusted_setup, "<tests>"), ns)
    except Exception as e:  # noqa: BLE001 -- broken test data must not read as the candidate's fault
        raise ValueError(f"test setup does not run: {type(e).__name__}: {e}") from None
    units = [_compile(t, f"<test {i}>") for i, t in enumerate(p.tests)]
    for name in set().union(*(_global_names(u) for u in units), *(_global_names(v.__code__) for v in _funcs(ns))):
        if name not in ns and not hasattr(builtins, name):
            ns[name] = _Remote(s, name)
    if p.entry_point:  # the prompt's stub of it is replaced too (HumanEval/33's test calls it by name)
        ns["candidate"] = ns[p.entry_point] = _Remote(s, p.entry_point)
    results = [_run_unit(u, ns, s) for u in units]
    return results, s.answers - 1  # the first answer acknowledged the code, not a call


def _funcs(ns: dict):
    return [v for v in ns.values() if callable(v) and hasattr(v, "__code__")]


def same_output(got: str, want: str, tol: float = 0.0) -> bool:
    """Line by line, trailing whitespace of each line and trailing blank lines ignored; with tol > 0, tokens
    that both parse as floats match within tol (absolute or relative). Never a set comparison or a zip that
    drops lines."""
    g, w = got.rstrip().split("\n"), want.rstrip().split("\n")
    if len(g) != len(w):
        return False
    for a, b in zip(g, w, strict=True):
        a, b = a.rstrip(), b.rstrip()
        if a == b:
            continue
        if tol <= 0:
            return False
        ta, tb = a.split(), b.split()
        if len(ta) != len(tb) or not all(_same_token(x, y, tol) for x, y in zip(ta, tb, strict=True)):
            return False
    return True


def _same_token(a: str, b: str, tol: float) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def _drive_stdio(p: Program, job: Job) -> tuple[list[str | None], int]:
    s = _Session(job)
    err = _load(s, p, "__main__")
    if err:
        return [err] * len(p.cases), s.answers
    results: list[str | None] = []
    for stdin, want in p.cases:
        try:
            reply = s.ask({"stdin": stdin})
        except _Fatal as e:
            results.append(e.cls)
            continue
        out, raised = reply.get("stdout"), reply.get("raise")
        if not isinstance(out, str) or raised is not None:
            results.append("memory" if raised == "MemoryError" else "runtime_error")
        else:
            results.append(None if same_output(out, want, p.float_tol) else "wrong_answer")
    return results, s.answers - 1


def judge(pool: Pool, p: Program, timeout_s: float) -> Verdict:
    """Run one program against its tests; the verdict is decided here, after the job's processes are gone."""
    drive = _drive_call if p.kind == "call" else _drive_stdio
    ran = pool.run(lambda job: drive(p, job), timeout_s)
    if not ran.clean or ran.result is None:
        return Verdict(False, 0.0, "sandbox_error")
    results, answers = ran.result
    n = len(results)
    fraction = sum(r is None for r in results) / n if n else 0.0
    failures = [r for r in results if r is not None]
    if not failures and answers > 0 and n > 0:
        return Verdict(True, 1.0, None)
    if not failures:  # no test unit asked the candidate anything: nothing was verified
        return Verdict(False, 0.0, "sandbox_error")
    cls = min(failures, key=FAILURE_CLASSES.index)
    if cls == "runtime_error" and ran.status is not None and os.WIFSIGNALED(ran.status):
        if os.WTERMSIG(ran.status) == signal.SIGXCPU:
            cls = "timeout"
    return Verdict(False, fraction, cls)


def judge_batch(pool: Pool, programs: Sequence[Program], timeout_s: float) -> list[Verdict]:
    """All programs in parallel over the pool's workers, in order; each bounded by its own deadline."""
    if not programs:
        return []
    with ThreadPoolExecutor(max_workers=min(pool.size, len(programs)), thread_name_prefix="judge") as ex:
        return list(ex.map(lambda p: judge(pool, p, timeout_s), programs))
