"""The code family: records of each format -> Example.meta, and CodeTask, which owns its sandbox pool.

Record fields, per task (task.name; the data section's question_key/answer_key do not apply):
- humaneval: prompt, test (defines `check(candidate)`), entry_point; optional canonical_solution (SFT
  target). The prompt is the question; a completion continues it or gives a fenced block.
- mbpp: text, test_list (assert lines), optional test_setup_code and code (SFT target). The question is the
  text plus the first test, which shows the function's name and signature (MBPP's own prompting shows all
  three).
- stdio: question, and the tests as `inputs` + `outputs` lists, a `tests` list of {input, output}, or an
  APPS-style `input_output` JSON string; optional float_tol (numeric tokens equal within it) and solution.

Reward: 1 when every test unit passes, else 0. reward/pass_frac_mean is the fraction of test units passed
(an MBPP assert, a stdin/stdout pair; HumanEval's check() is one unit); reward/fail_<class> counts programs
per failure class.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rl_training.config.schema import SandboxCfg
from rl_training.data.sources import DataError, Example
from rl_training.sandbox.confinement import PoolSettings
from rl_training.sandbox.pool import Pool
from rl_training.tasks.base import Scores, Task, TaskContext
from rl_training.tasks.code import CODE_FORMATS, COUNT_NAMES, FAILURE_CLASSES, PART_NAMES
from rl_training.tasks.code.extract import has_code, program_for
from rl_training.tasks.code.harness import Program, judge_batch

log = logging.getLogger(__name__)


def _need(rec: dict, key: str, typ: type, where: str):
    if key not in rec:
        raise DataError(f"{where}: missing key '{key}' (has: {', '.join(map(str, rec))})")
    if not isinstance(rec[key], typ):
        raise DataError(f"{where}: key '{key}' must be {typ.__name__}, got {type(rec[key]).__name__}")
    return rec[key]


def _compiles(src: str, where: str, what: str) -> None:
    try:
        compile(src, where, "exec")
    except (SyntaxError, ValueError) as e:
        raise DataError(f"{where}: {what} does not compile ({type(e).__name__}: {e})") from None


def _prompt_stub(prompt: str) -> str:
    """The prompt completed into code that runs (its helpers, e.g. HumanEval/32's `poly`, are what tests
    call): a docstring-ended prompt gets `pass`, one ending at `return ` gets `None`; a prompt that neither
    completes gives no helpers (the tests' names then reach the candidate's program)."""
    for stub in ("    pass\n", "None\n", "\n"):
        try:
            compile(prompt + stub, "<prompt>", "exec")
            return prompt + stub + "\n"
        except (SyntaxError, ValueError):
            continue
    return ""


def _stdio_cases(rec: dict, where: str) -> list[list[str]]:
    if "input_output" in rec:
        io = rec["input_output"]
        try:
            io = json.loads(io) if isinstance(io, str) else io
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: input_output is not JSON ({e.msg})") from None
        rec = {**rec, **io}
    if "tests" in rec:
        tests = _need(rec, "tests", list, where)
        pairs = [(t.get("input"), t.get("output")) if isinstance(t, dict) else (None, None) for t in tests]
    else:
        pairs = list(zip(_need(rec, "inputs", list, where), _need(rec, "outputs", list, where), strict=False))
        if len(rec["inputs"]) != len(rec["outputs"]):
            raise DataError(f"{where}: {len(rec['inputs'])} inputs for {len(rec['outputs'])} outputs")
    if not pairs or not all(isinstance(i, str) and isinstance(o, str) for i, o in pairs):
        raise DataError(f"{where}: stdio tests must be a non-empty list of (input, output) strings")
    return [[i, o] for i, o in pairs]


def code_example(fmt: str, rec: dict[str, Any], where: str) -> Example:
    """One record of a code format as an Example whose meta carries the tests (see the module docstring)."""
    if fmt == "humaneval":
        prompt, test = _need(rec, "prompt", str, where), _need(rec, "test", str, where)
        entry = _need(rec, "entry_point", str, where)
        _compiles(test, where, "test")
        meta = {"kind": "call", "prompt": prompt, "trusted_setup": _prompt_stub(prompt) + test}
        meta |= {"tests": ["check(candidate)"], "entry_point": entry}
        return Example(prompt, entry, str(rec.get("canonical_solution", "")), where, meta)
    if fmt == "mbpp":
        text, tests = _need(rec, "text", str, where), _need(rec, "test_list", list, where)
        if not tests or not all(isinstance(t, str) for t in tests):
            raise DataError(f"{where}: test_list must be a non-empty list of strings")
        setup = str(rec.get("test_setup_code") or "")
        for t in tests:
            _compiles(setup + "\n" + t, where, f"test {t[:60]!r}")
        meta = {"kind": "call", "tests": tests, "trusted_setup": setup, "candidate_setup": setup}
        return Example(f"{text}\n{tests[0]}", "", str(rec.get("code", "")), where, meta)
    if fmt == "stdio":
        question = _need(rec, "question", str, where)
        tol = rec.get("float_tol", 0.0)
        if not isinstance(tol, int | float) or not 0 <= tol < 1:
            raise DataError(f"{where}: float_tol must be a number in [0, 1), got {tol!r}")
        meta = {"kind": "stdio", "cases": _stdio_cases(rec, where), "float_tol": float(tol)}
        return Example(question, "", str(rec.get("solution", "")), where, meta)
    raise DataError(f"unknown code format {fmt!r} (one of humaneval, mbpp, stdio)")


def program_of(completion: str, ex: Example) -> Program:
    m = ex.meta
    if m["kind"] == "stdio":
        code = program_for(completion)
        return Program(code, "stdio", cases=tuple(map(tuple, m["cases"])), float_tol=m["float_tol"])
    code = program_for(completion, m.get("prompt", ""), m.get("entry_point", ""))
    return Program(
        code,
        "call",
        tests=tuple(m["tests"]),
        trusted_setup=m.get("trusted_setup", ""),
        candidate_setup=m.get("candidate_setup", ""),
        entry_point=m.get("entry_point", ""),
    )


def score_code_batch(pool: Pool, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
    """Every program judged in `pool`, in parallel."""
    formatted = [has_code(c) for c in completions]
    programs = [program_of(c, ex) for c, ex in zip(completions, examples, strict=True)]
    verdicts = judge_batch(pool, programs, timeout_s)
    rewards = [1.0 if v.passed else 0.0 for v in verdicts]
    fails = Counter(v.failure for v in verdicts if v.failure)
    counts = {f"fail_{c}": float(fails[c]) for c in FAILURE_CLASSES}
    counts["no_code"] = float(sum(not f for f in formatted))
    counts["sandbox_weak"] = float(len(programs)) if pool.settings.mode == "weak" else 0.0
    if pool.settings.mode == "weak":
        log.warning(
            "sandbox.mode=weak: %d programs ran without namespaces (no network, filesystem or process "
            "isolation; rlimits and an unprivileged uid only). See docs/code.md.",
            len(programs),
        )
    return Scores(
        rewards,
        [v.passed for v in verdicts],
        formatted,
        errors=0,
        timeouts=0,
        invalid=0,
        parts={PART_NAMES[0]: [v.fraction for v in verdicts]},
        counts=counts,
    )


class CodeTask(Task):
    """humaneval / mbpp / stdio: programs judged in this task's sandbox pool, a batch per call. The pool is the
    task's own: it starts in `start` with the run's sandbox.* (the defaults without a config), so a node that
    cannot run it fails at setup (SandboxUnavailable says why), and `close` ends it. A user task that grades
    programs subclasses it (its own `parse`, the same pool and verdicts; docs/extending.md)."""

    reward_range = (0.0, 1.0)
    part_names = PART_NAMES
    count_names = COUNT_NAMES

    def __init__(self, fmt: str = "stdio"):
        if fmt not in CODE_FORMATS:
            raise ValueError(f"CodeTask format must be one of {', '.join(CODE_FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.pool: Pool | None = None

    def parse(self, record: dict, where: str) -> Example:
        return code_example(self.fmt, record, where)

    def start(self, ctx: TaskContext | None = None) -> None:
        ctx = ctx or TaskContext()
        s = getattr(ctx.cfg, "sandbox", None) or SandboxCfg()
        self.close()  # a second start replaces the pool
        self.pool = Pool(PoolSettings.from_cfg(s, ranks_per_node=ctx.local_world_size))
        if ctx.rank == 0:  # once per run, in its log: what confines the programs of this node
            print(f"code sandbox protections: {self.pool.protections.summary()}", flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def has_answer(self, completion: str) -> bool:
        return has_code(completion)

    def grade(self, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
        if self.pool is None:
            raise RuntimeError("CodeTask.grade before start(): no sandbox pool")
        return score_code_batch(self.pool, completions, examples, timeout_s)
