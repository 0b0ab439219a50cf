"""The code task: the node check, the verdict protocol, task formats, the weak mode, parallel scoring under a
deadline, and the pool each task owns. The pool itself: tests/unit/sandbox/."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from rl_training.runners import sandbox_check as check
from rl_training.tasks.code import COUNT_NAMES
from rl_training.tasks.code.extract import function_continuation, last_fenced_block, program_for
from rl_training.tasks.code.harness import Program, judge_batch, same_output
from tests.helpers import sandbox_processes

ADD = Program("def add(a, b):\n    return a + b\n", "call", tests=("assert add(1, 2) == 3", "assert add(-1, 1) == 0"))


def test_node_check_holds(pool):
    results = check.run_checks(pool)
    assert [(n, d) for n, ok, d in results if not ok] == []
    assert len(results) == 14


def test_the_probe_skips_a_process_that_exits_while_it_reads():
    """The probe lists /proc, then reads each process's status; in weak mode it sees the host's processes, and one
    that exits in between (CI's side lane starts and ends many) once stopped the probe with FileNotFoundError.
    A pid above pid_max never exists: it is skipped; this process reads as its own status says (0 here, 2 under a
    container's filter)."""
    import os

    ns: dict = {}
    exec(check.PROBE.split("def facts(")[0], ns)  # only the definitions above facts(): nothing runs, no unshare
    gone = int(open("/proc/sys/kernel/pid_max").read()) + 1
    mine = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("Seccomp:"))
    assert ns["seccomp_modes"]([os.getpid(), gone]) == {os.getpid(): mine}


def test_same_output_line_rules():
    assert same_output("1 2\n3  \n\n\n", "1 2\n3")  # trailing spaces and blank lines ignored
    assert not same_output("1 2\n3", "1 2\n3\n4")  # a missing line is never zipped away
    assert not same_output("3\n1 2", "1 2\n3")  # order matters (no set comparison)
    assert not same_output(" 1", "1")  # leading whitespace counts
    assert not same_output("0.3333", "0.33333333")
    assert same_output("0.3333 x", "0.33333333 x", tol=1e-3)  # |diff| = 3.3e-5 <= 1e-3
    assert not same_output("0.33 x", "0.33333333 x", tol=1e-3)  # |diff| = 3.3e-3 > 1e-3


def test_extract_code():
    text = "Sure:\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\ndone"
    assert last_fenced_block(text) == "x = 2\n"
    assert last_fenced_block("```python\nx = 3\n") == "x = 3\n"  # cut off by the token limit
    assert last_fenced_block("no code") is None
    cont = function_continuation("    return 1\n\ndef g():\n    pass\nprint(g())\n")
    assert cont == "    return 1\n\ndef g():\n    pass"
    prompt = "def f(x):\n    '''doc'''\n"
    assert program_for("    return x\n```", prompt, "f") == prompt + "    return x"
    fenced = program_for("```python\ndef f(x):\n    return 2\n```", prompt, "f")
    assert fenced.startswith(prompt) and fenced.endswith("def f(x):\n    return 2\n")
    # a prompt ending inside a line (the synthetic task's `return `): the first line finishes it, the next
    # column-0 prose still ends the program
    mid = "def f(x):\n    return "
    assert program_for("'z' + x[::-1]\nThis reverses x.", mid, "f") == mid + "'z' + x[::-1]"
    assert program_for("x.upper()\n", mid, "f") == mid + "x.upper()\n"


def test_verdicts_and_failure_classes(pool):
    cases = {
        "def add(a, b):\n    return a + b\n": (True, 1.0, None),
        "def add(a, b):\n    return abs(a) + b\n": (False, 0.5, "wrong_answer"),  # |1|+2 = 3 holds, |-1|+1 = 2 != 0
        "def add(a, b):\n    return a - b\n": (False, 0.0, "wrong_answer"),
        "def add(a, b)\n    return a\n": (False, 0.0, "syntax"),
        "def add(a, b):\n    return [].x\n": (False, 0.0, "runtime_error"),
        "def add(a, b):\n    while True: pass\n": (False, 0.0, "timeout"),
        "def add(a, b):\n    return bytearray(1 << 34)\n": (False, 0.0, "memory"),
        "raise SystemExit(0)\n": (False, 0.0, "runtime_error"),
    }
    progs = [Program(code, "call", tests=ADD.tests) for code in cases]
    got = judge_batch(pool, progs, timeout_s=2.0)
    assert [(v.passed, v.fraction, v.failure) for v in got] == list(cases.values())
    assert set(sandbox_processes(pool).values()) == {1}  # every job's processes are gone: the template is left


def test_stdio_and_mbpp_formats(pool):
    from rl_training.tasks.code.task import code_example, program_of

    st = code_example("stdio", {"question": "sum", "inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12"]}, "t:1")
    good = "a, b = map(int, input().split())\nprint(a + b)\nexit(0)\n"
    half = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b if a < 5 else 0)\n"
    v = judge_batch(pool, [program_of(f"```python\n{c}```", st) for c in (good, half)], 5.0)
    assert [(x.passed, x.fraction, x.failure) for x in v] == [(True, 1.0, None), (False, 0.5, "wrong_answer")]
    mb = code_example(
        "mbpp",
        {"text": "square", "test_list": ["assert sq(2) == 4", "assert sq(3) == K"], "test_setup_code": "K = 9"},
        "t:2",
    )
    assert mb.question == "square\nassert sq(2) == 4"
    v = judge_batch(pool, [program_of("```python\ndef sq(x):\n    return x * x\n```", mb)], 5.0)
    assert v[0].passed


def test_code_task_through_score_completions(tmp_path, capsys):
    from rl_training.data.sources import load_examples
    from rl_training.tasks.base import score_completions
    from rl_training.tasks.build import make_task

    task = make_task("mbpp")
    task.start(None)  # bubblewrap present (the pool fixture of the other tests installs it); rank 0 prints
    try:
        (started,) = [x for x in capsys.readouterr().out.splitlines() if "protections" in x]
        assert started.startswith("code sandbox protections: mode strict, namespaces on, uid 65534, seccomp on (")
        f = tmp_path / "mbpp.jsonl"
        f.write_text(json.dumps({"text": "double", "test_list": ["assert d(2) == 4", "assert d(0) == 0"]}) + "\n")
        exs = load_examples(str(f), task.parse)
        assert exs[0].meta["tests"] == ["assert d(2) == 4", "assert d(0) == 0"]
        comps = ["```python\ndef d(x):\n    return 2 * x\n```", "```python\ndef d(x):\n    return x + 2\n```", ""]
        s = score_completions(task, comps, exs * 3, 5.0)
    finally:
        task.close()
    assert task.pool is None
    assert s.rewards == [1.0, 0.0, 0.0] and s.correct == [True, False, False] and s.formatted == [True, True, False]
    assert s.parts == {"pass_frac": [1.0, 0.5, 0.0]}  # x+2: d(2) = 4 holds, d(0) = 2 != 0
    assert set(s.counts) == set(COUNT_NAMES)
    assert s.counts["fail_wrong_answer"] == 1 and s.counts["fail_runtime_error"] == 1  # "": d is not defined
    assert s.counts["no_code"] == 1 and s.counts["sandbox_weak"] == 0


def test_batch_is_parallel_and_bounded_by_the_deadline(pool, monkeypatch):
    from rl_training.tasks.code import harness

    slow = Program("import time\ndef add(a, b):\n    time.sleep(60)\n", "call", tests=ADD.tests)
    spans = []  # (start, end) of each slow program's judging, as judge_batch's threads ran it
    judge = harness.judge

    def timed(pool, p, timeout_s):
        t0 = time.monotonic()
        try:
            return judge(pool, p, timeout_s)
        finally:
            if p is slow:
                spans.append((t0, time.monotonic()))

    monkeypatch.setattr(harness, "judge", timed)
    v = judge_batch(pool, [slow, ADD, ADD, ADD, ADD, slow], timeout_s=1.5)
    assert [x.passed for x in v] == [False, True, True, True, True, False]
    assert v[0].failure == v[5].failure == "timeout"  # the deadline ended them, not the 60 s sleep (wrong_answer)
    # 2 workers: the two sleepers overlap (one per worker), the 4 quick ones use the other worker meanwhile (the
    # second sleeper, last in the batch, starts only once they are done). Run serially, one ends before the next.
    (s1, e1), (s2, e2) = spans
    assert max(s1, s2) < min(e1, e2), spans
    # Each is bounded by its deadline: 1.5 s (plus the reap) when it holds, 60 s when it does not; halfway: 30 s.
    assert max(e1 - s1, e2 - s2) < 30, spans


def test_weak_mode_is_explicit_warned_and_counted(caplog):
    from rl_training.sandbox.confinement import PoolSettings
    from rl_training.sandbox.pool import Pool
    from rl_training.tasks.code.task import code_example, score_code_batch

    ex = code_example("mbpp", {"text": "t", "test_list": ["assert f() == 1"]}, "t:1")
    with Pool(PoolSettings(workers=1, mode="weak")) as pool:
        facts = check.probe_facts(pool)
        assert facts["uid"] == 65534 and facts["limits"]["RLIMIT_NPROC"] == 8
        for _ in range(2):  # every batch warns, not only the first
            s = score_code_batch(pool, ["```python\ndef f():\n    return 1\n```"] * 3, [ex] * 3, 5.0)
            assert s.rewards == [1.0] * 3 and s.counts["sandbox_weak"] == 3
        assert sum("sandbox.mode=weak" in r.message for r in caplog.records) == 2
        assert pool.weak_runs == 7  # the probe + 2 x 3


def test_a_test_that_swallows_exceptions_cannot_hide_a_timeout(pool):
    # The trusted test catches everything, as some datasets' tests do; the hang still fails the program.
    test = "try:\n    r = f(1)\nexcept Exception:\n    r = 2\nassert r == 2"
    hang = Program("def f(x):\n    while True:\n        pass\n", "call", tests=(test,))
    raises = Program("def f(x):\n    raise ValueError\n", "call", tests=(test,))
    v = judge_batch(pool, [hang, raises], 1.5)
    assert [(x.passed, x.failure) for x in v] == [(False, "timeout"), (True, None)]  # a raise is caught, as in CPython


def test_synthetic_task_shows_reversal_through_its_marker():
    """The shown inputs start with MARK and hold it once (so the marker's place in an output shows reversal);
    the hidden inputs are plain random strings: of 4000 x 4, about 1 - (15/16)^5 = 28% hold an 'a' anywhere
    (lengths 4-6) and 1/16 = 6% start with it, so a program must really reverse."""
    import re

    from rl_training.tasks.code.synthetic import MARK, make_code_splits

    train, _ = make_code_splits(4000, 0, seed=0)
    shown = [w for p in train for w in re.findall(r"# f\('(\w+)'\)", p["prompt"])]
    hidden = [w for p in train for w in re.findall(r"candidate\('(\w+)'\)", p["test"])]
    assert len(shown) == 8000 and len(hidden) == 16000
    assert all(w[0] == MARK and w.count(MARK) == 1 for w in shown)
    assert 0.05 < sum(w[0] == MARK for w in hidden) / len(hidden) < 0.075
    assert 0.22 < sum(MARK in w for w in hidden) / len(hidden) < 0.34


def test_synthetic_task_is_graded_on_hidden_inputs(pool):
    """The demo's task (rl_training/tasks/code/synthetic.py) through the real scorer: each of the 12 programs'
    canonical expression passes its prompt's hidden tests; a completion that differs in one feature, or
    hard-codes the first shown example's output, fails."""
    from rl_training.tasks.code.synthetic import PROGRAMS, make_code_splits
    from rl_training.tasks.code.task import code_example, score_code_batch

    train, held = make_code_splits(60, 12, seed=3)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}  # disjoint splits
    by_program = {p["canonical_solution"].strip(): p for p in train + held}
    assert set(by_program) == set(PROGRAMS)  # 72 problems cover all 12 programs (seed 3)
    exs, completions, want = [], [], []
    for expr, rec in by_program.items():
        ex = code_example("humaneval", rec, rec["task_id"])
        flipped = expr.replace(".upper()", "") if ".upper()" in expr else expr.replace("x", "x.upper()", 1)
        shown = rec["prompt"].split("== ")[1].split("\n")[0]  # the first example's output literal
        exs += [ex] * 3
        completions += [expr + "\n", flipped + "\n", shown + "\n"]
        want += [1.0, 0.0, 0.0]
    scores = score_code_batch(pool, completions, exs, timeout_s=5.0)
    assert scores.rewards == want


class StandInPool:
    """A Pool that records its settings and its close, and starts no sandbox."""

    def __init__(self, settings):
        self.settings, self.closed = settings, False
        self.protections = SimpleNamespace(summary=lambda: "stand-in")

    def close(self):
        self.closed = True


def test_code_task_sizes_its_pool_for_the_ranks_of_its_node(monkeypatch):
    """CodeTask.start hands the config's sandbox.* and the node's rank count to the pool settings."""
    from rl_training.config.load import load_config
    from rl_training.tasks.base import TaskContext
    from rl_training.tasks.build import make_task
    from rl_training.tasks.code import task as code_task

    monkeypatch.setattr(code_task, "Pool", StandInPool)  # settings only: no sandbox started here
    cfg = load_config(None, ["task.name=mbpp", "sandbox.memory_mb=256", "sandbox.output_kb=8"])
    task = make_task("mbpp")
    task.start(TaskContext(local_world_size=4, cfg=cfg))
    s = task.pool.settings
    assert (s.ranks_per_node, s.workers, s.limits.mem_bytes, s.limits.msg_bytes) == (4, 0, 256 << 20, 8 << 10)
    assert not s.fresh


@pytest.mark.parametrize("name", ["mbpp", "python_math"])
def test_each_task_instance_owns_its_pool(monkeypatch, name):
    """Issue 39: the pool belongs to the task that started it, not to its module. Two instances of one task hold
    two pools; closing one closes its own and leaves the other running; a second start replaces the first pool."""
    from rl_training.tasks import python_tool
    from rl_training.tasks.build import make_task
    from rl_training.tasks.code import task as code_task

    monkeypatch.setattr(code_task, "Pool", StandInPool)
    monkeypatch.setattr(python_tool, "Pool", StandInPool)
    a, b = make_task(name), make_task(name)
    a.start(None)
    b.start(None)
    first_a, pool_b = a.pool, b.pool
    assert isinstance(first_a, StandInPool) and first_a is not pool_b
    assert pool_b.settings.fresh == (name == "python_math")  # the python tool: a sandbox per call
    a.start(None)
    assert first_a.closed and a.pool is not first_a and not pool_b.closed
    second_a = a.pool
    a.close()
    assert second_a.closed and a.pool is None and not pool_b.closed
    b.close()
    assert pool_b.closed and b.pool is None
