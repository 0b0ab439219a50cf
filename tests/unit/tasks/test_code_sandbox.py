"""The code sandbox: isolation facts, the verdict protocol, task formats, refusal without namespaces, the
weak mode, and parallel scoring under a deadline. Adversarial programs: test_code_adversarial.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_training.tasks.code import COUNT_NAMES, check, worker
from rl_training.tasks.code.extract import function_continuation, last_fenced_block, program_for
from rl_training.tasks.code.harness import Program, judge, judge_batch, same_output
from tests.helpers import sandbox_processes

ADD = Program("def add(a, b):\n    return a + b\n", "call", tests=("assert add(1, 2) == 3", "assert add(-1, 1) == 0"))


def test_node_check_holds(pool):
    results = check.run_checks(pool)
    assert [(n, d) for n, ok, d in results if not ok] == []
    assert len(results) == 14


def test_codec_roundtrip_keeps_types_and_refuses_objects():
    v = [1, 2.5, "s", None, True, (1, (2,)), {3, 4}, frozenset({5}), {(1, 2): [b"\xff"]}, 1j, float("inf")]
    got = worker.decode(json.loads(json.dumps(worker.encode(v))))
    assert got == v and type(got[5]) is tuple and type(got[6]) is set and type(got[8]) is dict
    assert math.isnan(worker.decode(worker.encode(float("nan"))))

    class Always:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError):
        worker.encode(Always())
    for forged in ({"$t": [1], "$s": [2]}, {"__class__": "x"}, {"$d": [[[1], 2]]}, {"$c": ["a", 1]}):
        with pytest.raises((ValueError, TypeError)):
            worker.decode(forged)


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
    (started,) = [x for x in capsys.readouterr().out.splitlines() if "protections" in x]
    assert started.startswith("code sandbox protections: mode strict, namespaces on, uid 65534, seccomp on (")
    f = tmp_path / "mbpp.jsonl"
    f.write_text(json.dumps({"text": "double", "test_list": ["assert d(2) == 4", "assert d(0) == 0"]}) + "\n")
    exs = load_examples(str(f), task.parse)
    assert exs[0].meta["tests"] == ["assert d(2) == 4", "assert d(0) == 0"]
    comps = ["```python\ndef d(x):\n    return 2 * x\n```", "```python\ndef d(x):\n    return x + 2\n```", ""]
    s = score_completions(task, comps, exs * 3, 5.0)
    assert s.rewards == [1.0, 0.0, 0.0] and s.correct == [True, False, False] and s.formatted == [True, True, False]
    assert s.parts == {"pass_frac": [1.0, 0.5, 0.0]}  # x+2: d(2) = 4 holds, d(0) = 2 != 0
    assert set(s.counts) == set(COUNT_NAMES)
    assert s.counts["fail_wrong_answer"] == 1 and s.counts["fail_runtime_error"] == 1  # "": d is not defined
    assert s.counts["no_code"] == 1 and s.counts["sandbox_weak"] == 0


def test_batch_is_parallel_and_bounded_by_the_deadline(pool):
    slow = Program("import time\ndef add(a, b):\n    time.sleep(60)\n", "call", tests=ADD.tests)
    t = time.monotonic()
    v = judge_batch(pool, [slow, ADD, ADD, ADD, ADD, slow], timeout_s=1.5)
    took = time.monotonic() - t
    assert [x.passed for x in v] == [False, True, True, True, True, False]
    assert v[0].failure == "timeout"
    # 2 workers: the two sleepers overlap (one per worker), the 4 quick ones use the other worker meanwhile:
    # about one deadline (1.5 s), well under the 2 x 60 s of waiting for them, or even 2 x 1.5 s serially.
    assert took < 2.9


# ---------------------------------------------------------------- a sandbox per job (the python tool's pool)
# The first job's program leaves what a reused worker's cleanup cannot remove: a directory it made unreadable.
PLANT = Program(
    "import os\n"
    "def f():\n"
    "    os.mkdir('/tmp/locked')\n"
    "    open('/tmp/locked/secret', 'w').write('42')\n"
    "    os.chmod('/tmp/locked', 0)\n"
    "    open('/dev/shm/marker', 'w').write('42')\n"
    "    return sorted(os.listdir('/tmp') + os.listdir('/dev/shm')), os.getpid()\n",
    "call",
    tests=("assert f() == (['locked', 'marker'], 2)",),  # the template is pid 1 (bwrap --as-pid-1), a job 2
)
LOOK = Program("import os\ndef f():\n    return os.listdir('/tmp') + os.listdir('/dev/shm'), os.getpid()\n",
               "call", tests=("assert f() == ([], 2)",))  # fmt: skip


def bwrap_pids(pool) -> list[int]:
    """The host pid of the bwrap each later job of `pool` runs in, recorded as the jobs take their workers."""
    seen, take = [], pool.acquire

    def acquire():
        w = take()
        seen.append(w.proc.pid)
        return w

    pool.acquire = acquire
    return seen


def test_a_fresh_pool_gives_every_job_a_sandbox_of_its_own():
    """PoolSettings.fresh: no job sees a file, a directory or the pid counter of an earlier one, and no sandbox
    serves two jobs. The reused pool (the code tasks') still serves the jobs of a 1-worker pool from one sandbox."""
    from rl_training.tasks.code.sandbox import Pool, PoolSettings

    with Pool(PoolSettings(workers=1, fresh=True)) as fresh:
        seen = bwrap_pids(fresh)
        got = [judge(fresh, p, 5.0) for p in (PLANT, LOOK, PLANT, LOOK)]
        assert [(v.passed, v.failure) for v in got] == [(True, None)] * 4
        assert len(seen) == 4 and len(set(seen)) == 4 and fresh.restarts == 0
    with Pool(PoolSettings(workers=1)) as reused:
        seen = bwrap_pids(reused)
        assert judge(reused, ADD, 5.0).passed and judge(reused, ADD, 5.0).passed
        assert len(seen) == 2 and len(set(seen)) == 1


def test_fresh_sandboxes_start_side_by_side_and_close_kills_those_starting():
    """Handing out a worker starts its replacement in the background; two start at once (bwrap is forked on the
    spawner thread, the wait for the template is not), and Pool.close kills them mid-start, at once, as well as
    the ones whose jobs end after it. The replacements here run an interpreter that never answers, so a close that
    waited for them would take the 20 s a start is given."""
    from rl_training.tasks.code.sandbox import Pool, PoolSettings

    before = set(worker.descendants(os.getpid()))
    # readable by the sandbox uid (tmp_path is not), and outside /tmp, which the sandbox mounts over
    bindir = Path(tempfile.mkdtemp(prefix="mute-python-", dir="/var/tmp"))
    (bindir / "bin").mkdir()
    mute = bindir / "bin" / "python"
    mute.write_text("#!/bin/sh\nexec sleep 60\n")
    for f in (bindir, bindir / "bin", mute):
        f.chmod(0o755)
    pool = Pool(PoolSettings(workers=2, fresh=True))
    try:
        pool.python = str(mute)  # the pool's own two started normally; their replacements do not
        busy = [pool.acquire(), pool.acquire()]
        deadline = time.monotonic() + 10.0
        while len(pool._starting) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(pool._starting) == 2  # both bwraps forked, both waiting for their templates
        t = time.monotonic()
        pool.close()
        assert time.monotonic() - t < 5.0
        with pytest.raises(RuntimeError, match="closed"):
            pool.acquire()
        for w in busy:
            pool.release(w, False)
        assert set(worker.descendants(os.getpid())) <= before  # every bwrap of the pool is gone (and reaped)
    finally:
        pool.close()
        shutil.rmtree(bindir)


def test_refuses_without_user_namespaces(monkeypatch):
    from rl_training.tasks.code.sandbox import Pool, PoolSettings, SandboxUnavailable

    # A bwrap that fails as it does where user namespaces are off, in a directory the sandbox uid can read
    # (pytest's tmp_path is private to root).
    bindir = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    bindir.chmod(0o755)
    fake = bindir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    with pytest.raises(SandboxUnavailable, match="No permissions.*user.max_user_namespaces.*sandbox.mode=weak"):
        Pool(PoolSettings(workers=1))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        Pool(PoolSettings(workers=1))
    shutil.rmtree(bindir)


def test_weak_mode_is_explicit_warned_and_counted(caplog):
    from rl_training.tasks.code import task as tasks
    from rl_training.tasks.code.task import code_example, configure, score_code_batch

    ex = code_example("mbpp", {"text": "t", "test_list": ["assert f() == 1"]}, "t:1")
    configure(workers=1, mode="weak")
    try:
        pool = tasks.get_pool()
        facts = check.probe_facts(pool)
        assert facts["uid"] == 65534 and facts["limits"]["RLIMIT_NPROC"] == 8
        for _ in range(2):  # every batch warns, not only the first
            s = score_code_batch(["```python\ndef f():\n    return 1\n```"] * 3, [ex] * 3, 5.0)
            assert s.rewards == [1.0] * 3 and s.counts["sandbox_weak"] == 3
        assert sum("sandbox.mode=weak" in r.message for r in caplog.records) == 2
        assert pool.weak_runs == 7  # the probe + 2 x 3
    finally:
        configure()  # back to the strict default for the other tests


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
    scores = score_code_batch(completions, exs, timeout_s=5.0)
    assert scores.rewards == want


def test_pool_size_is_the_ranks_share_of_the_node():
    """Issue 29 N7: 4 ranks bound to one 112-CPU socket of a 224-CPU node each see 112 CPUs; sized by the mask each
    would start 4 x 112 = 448 sandboxes (1,792 on the socket). The node's cores / its ranks: 4 x 56 each."""
    from rl_training.tasks.code.sandbox import WORKERS_PER_CORE, default_cores

    assert default_cores(ranks_per_node=4, affinity=112, node_cores=224) == 56
    assert default_cores(ranks_per_node=1, affinity=112, node_cores=224) == 112  # never more than the mask
    assert default_cores(ranks_per_node=8, affinity=2, node_cores=2) == 1  # at least one core
    assert WORKERS_PER_CORE * default_cores(4, 112, 224) * 4 == 896  # 4 per CPU over the node's 224


def test_code_task_sizes_its_pool_for_the_ranks_of_its_node(monkeypatch):
    """CodeTask.start hands the config's sandbox.* and the node's rank count to the pool settings."""
    from rl_training.config.load import load_config
    from rl_training.tasks.base import TaskContext
    from rl_training.tasks.build import make_task
    from rl_training.tasks.code import task as code_task

    stand_in = SimpleNamespace(protections=SimpleNamespace(summary=lambda: "stand-in"))
    monkeypatch.setattr(code_task, "get_pool", lambda: stand_in)  # settings only: no sandbox started here
    monkeypatch.setattr(code_task, "_settings", code_task.PoolSettings())
    cfg = load_config(None, ["task.name=mbpp", "sandbox.memory_mb=256"])
    make_task("mbpp").start(TaskContext(local_world_size=4, cfg=cfg))
    s = code_task._settings
    assert (s.ranks_per_node, s.workers, s.limits.mem_bytes) == (4, 0, 256 << 20)


# ------------------------------------------------------------------ the filter, the memory bound, the report
# Issue 30's list: what the filter must refuse at least (Docker's default profile refuses them, or more).
MUST_DENY = """
io_uring_setup io_uring_enter io_uring_register keyctl add_key request_key bpf userfaultfd perf_event_open ptrace
process_vm_readv process_vm_writev mount umount2 pivot_root move_mount open_tree fsopen fsmount fsconfig fspick
unshare setns init_module finit_module delete_module kexec_load kexec_file_load reboot swapon swapoff acct quotactl
lookup_dcookie syslog settimeofday clock_settime adjtimex iopl ioperm name_to_handle_at open_by_handle_at
memfd_create shmget shmat
""".split()


def test_filter_lists_name_real_system_calls_and_deny_the_issues_list():
    import pyseccomp

    from rl_training.tasks.code import seccomp_filter as sf

    arches = (pyseccomp.Arch.X86_64, pyseccomp.Arch.AARCH64)
    unknown = [n for n in sf.ALLOWED + sf.DENIED if all(pyseccomp.resolve_syscall(a, n) == -1 for a in arches)]
    assert unknown == []  # -1: no such name on any architecture libseccomp knows (a typo)
    assert len(set(sf.ALLOWED)) == len(sf.ALLOWED) and not set(sf.ALLOWED) & set(sf.DENIED)
    assert set(MUST_DENY) <= set(sf.DENIED)
    assert not {"clone", "clone3", "personality", "socket", *sf.MEMFD} & set(sf.ALLOWED)  # by argument or setting


def test_ordinary_programs_run_under_the_filter(pool):
    """What a test program may use: threads, a process pool (fork, POSIX semaphores in /dev/shm), a queue,
    temporary files, anonymous mmap, a subprocess."""
    code = (
        "import concurrent.futures, mmap, multiprocessing, os, subprocess, sys, tempfile, threading\n"
        "def f():\n"
        "    out = []\n"
        "    t = threading.Thread(target=lambda: out.append(1))\n"
        "    t.start()\n"
        "    t.join()\n"
        "    with concurrent.futures.ThreadPoolExecutor(2) as ex:\n"
        "        out += list(ex.map(abs, [-2, -3]))\n"
        "    with multiprocessing.Pool(2) as p:\n"
        "        out += p.map(abs, [-4, -5])\n"
        "    q = multiprocessing.Queue()\n"
        "    q.put(6)\n"
        "    out.append(q.get())\n"
        "    with tempfile.NamedTemporaryFile() as fh:\n"
        "        fh.write(b'x' * 7)\n"
        "        fh.flush()\n"
        "        out.append(os.path.getsize(fh.name))\n"
        "    m = mmap.mmap(-1, 1 << 20)\n"
        "    m[0] = 8\n"
        "    out.append(m[0])\n"
        "    run = subprocess.run([sys.executable, '-c', 'print(9)'], capture_output=True, text=True)\n"
        "    return out + [int(run.stdout)]\n"
    )
    v = judge(pool, Program(code, "call", tests=("assert f() == [1, 2, 3, 4, 5, 6, 7, 8, 9]",)), 20.0)
    assert (v.passed, v.failure) == (True, None)


def test_protections_are_reported(pool):
    from rl_training.tasks.code import seccomp_filter as sf
    from rl_training.tasks.code.sandbox import PoolSettings, confine, delegated_cgroup

    cgroup, why = delegated_cgroup()
    assert cgroup is None  # this machine (docs: cgroups are not delegated); the stand-in test covers the rest
    assert pool.protections.as_dict() == {
        "mode": "strict",
        "namespaces": True,
        "uid": 65534,
        "seccomp": True,
        "seccomp_allowed": len(sf.native_numbers(sf.ALLOWED)) + 4,  # + clone, personality, socket by argument
        "seccomp_refusal": "EPERM",
        "seccomp_denied": tuple(sf.native_numbers(sf.DENIED)),
        "memory": "memfd-denied+shm-in-tmpfs",
        "memory_note": f"no memory cgroup: {why}",
        "tmp_bytes": 48 << 20,
        "shm_bytes": 16 << 20,
    }
    line = pool.protections.summary()
    assert line.startswith("mode strict, namespaces on, uid 65534, seccomp on (") and "the rest EPERM" in line
    assert "memory memfd-denied+shm-in-tmpfs (no memory cgroup: " in line and line.endswith("+ 16 MiB /dev/shm")
    weak = confine(PoolSettings(mode="weak"))[1]
    assert (weak.namespaces, weak.seccomp, weak.memory, weak.tmp_bytes) == (False, False, "rlimits-only", 0)
    off = confine(PoolSettings(seccomp=False))[1]
    assert (off.namespaces, off.seccomp, off.seccomp_denied, off.memory) == (True, False, (), "rlimits-only")


def test_memory_cgroup_detection_says_why_not_here():
    from rl_training.tasks.code.sandbox import delegated_cgroup

    # cgroup v1 holds the memory controller here; the v2 hierarchy (hybrid) has none
    why = "cgroups are not delegated: no memory controller in /sys/fs/cgroup/unified (hugetlb)"
    assert delegated_cgroup() == (None, why)


def test_memory_cgroup_path_logic_on_a_stand_in(tmp_path, pool):
    """A temporary directory stands in for a delegated cgroup v2 subtree: the detection reads it as the kernel
    lays it out, and a worker started under it is moved into its own cgroup before bwrap runs."""
    from rl_training.tasks.code.sandbox import Confinement, PoolSettings, Worker, delegated_cgroup

    mount, proc, info = tmp_path / "cgroup2", tmp_path / "proc-self-cgroup", tmp_path / "mountinfo"
    d = mount / "job" / "step"
    d.mkdir(parents=True)
    proc.write_text("0::/job/step\n")
    info.write_text(f"30 23 0:27 / {mount} rw,nosuid - cgroup2 cgroup2 rw\n")
    (d / "cgroup.controllers").write_text("cpu memory pids\n")
    (d / "cgroup.subtree_control").write_text("cpu\n")
    detect = lambda: delegated_cgroup(str(proc), str(info))  # noqa: E731
    assert detect() == (None, f"cgroups are not delegated: memory is not in {d}/cgroup.subtree_control")
    (d / "cgroup.subtree_control").write_text("cpu memory\n")
    assert detect() == (d, f"delegated: {d}")
    info.write_text(f"30 23 0:27 /job {mount / 'job'} rw - cgroup2 cgroup2 rw\n")  # a subtree mounted
    assert detect() == (d, f"delegated: {d}")
    (d / "cgroup.controllers").write_text("cpu pids\n")
    assert detect() == (None, f"cgroups are not delegated: no memory controller in {d} (cpu pids)")
    info.write_text("25 1 0:22 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert detect() == (None, f"no cgroup2 file system in {info}")
    proc.write_text("4:memory:/job\n")
    assert detect() == (None, f"no cgroup v2 entry in {proc} (cgroup v1 only)")

    w = Worker(PoolSettings(workers=1), pool.python, Confinement(pool.confinement.bpf, d, 300 << 20))
    try:
        assert w.cgroup.parent == d and w.cgroup.name.startswith(f"rl-sandbox-{os.getpid()}-")
        assert (w.cgroup / "memory.max").read_text() == str(300 << 20)
        assert (w.cgroup / "cgroup.procs").read_text() == str(w.proc.pid)  # written while the child waited
        assert Path(f"/proc/{w.proc.pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/bwrap")  # then exec
        assert w.request({"op": "ping"}, 5.0) == {"op": "pong"}
    finally:
        for f in w.cgroup.iterdir():  # a real cgroup's interface files go with it; the stand-in's do not
            f.unlink()
        w.close()
    assert not w.cgroup.exists()


def test_strict_mode_refuses_without_libseccomp(monkeypatch):
    import sys

    from rl_training.tasks.code.sandbox import Pool, PoolSettings, SandboxUnavailable, confine

    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # as where the binding is not installed: ImportError
    with pytest.raises(SandboxUnavailable, match=r"libseccomp .*pip install -r requirements.txt.*sandbox.mode=weak"):
        Pool(PoolSettings(workers=1))
    assert confine(PoolSettings(mode="weak"))[1].seccomp is False  # the weak mode starts without it
