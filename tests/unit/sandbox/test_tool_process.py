"""ToolProcess (rl_training/sandbox/tool_process.py): a tool runs in a child process that a timeout kills from outside,
with everything it started, whatever the tool catches; a crash, a raise, an unrenderable value or a print is an
answer, never a dead trainer; and the next call runs in a fresh process.

The tools are this module's functions: the child imports them by reference (tests.unit.sandbox.test_tool_process).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rl_training.sandbox import worker
from rl_training.sandbox.tool_process import ToolFailed, ToolProcess


# --------------------------------------------------------------------------------------- the tools (module level)
def add(a: int, b: int) -> int:
    return a + b


def catches_exception(seconds: float) -> str:
    """Busy for `seconds`, swallowing any Exception (what defeats an in-process SIGALRM)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sum(range(1000))
        except Exception:  # noqa: BLE001 -- the hostile tool under test
            pass
    return "finished"


def catches_everything(seconds: float) -> str:
    """Busy for `seconds`, swallowing BaseException and ignoring SIGTERM and SIGINT."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sum(range(1000))
        except BaseException:  # noqa: BLE001 -- the hostile tool under test
            pass
    return "finished"


def starts_processes(pid_file: str) -> str:
    """A subprocess in its group, one in a session of its own, an orphan left in its group (its shell exited, so it
    is no longer below the child), a thread; then sleeps."""
    same = subprocess.Popen(["sleep", "30"])
    own = subprocess.Popen(["sleep", "30"], start_new_session=True)
    sh = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!"], stdout=subprocess.PIPE, text=True)
    orphan = int(sh.stdout.readline())
    sh.wait()
    threading.Thread(target=time.sleep, args=(30,)).start()
    Path(pid_file).write_text(f"{same.pid} {own.pid} {orphan}")
    time.sleep(30)
    return "finished"


def starts_sleep() -> int:
    return subprocess.Popen(["sleep", "30"]).pid


def exits(code: int) -> None:
    os._exit(code)


def kills_itself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def boom() -> None:
    raise ValueError("no 5")


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


def unprintable() -> None:
    raise Unprintable


class ExitingStr(Exception):
    def __str__(self):
        raise SystemExit("from __str__")  # past `except Exception`, which one_line may use


def exiting_str() -> None:
    raise ExitingStr


def fails() -> None:
    raise ToolFailed("custom", "text")


def calls_exit() -> None:
    sys.exit(2)


def interrupts() -> None:
    raise KeyboardInterrupt


def returns(kind: str):
    if kind == "big_int":
        return 10**5000
    if kind == "deep_list":
        out: list = []
        for _ in range(10_000):
            out = [out]
        return out
    if kind == "bytes":
        return b"caf\xc3\xa9 \xff"
    return {"a": 1}


def digit_count(n: int) -> int:
    sys.set_int_max_str_digits(0)  # this child's own limit: str() of the argument, whatever its size
    return len(str(n))


def prints() -> str:
    print("<tool_call> not the protocol " * 4000)
    os.write(1, b"\x00\x00\x00\x00\x00\x00\x00\x10garbage-frame")
    print("to stderr", file=sys.stderr)
    return "ok"


def returns_text(n: int) -> str:
    return "x" * n


def pid() -> int:
    return os.getpid()


def writes_into_the_channel() -> str:
    sock_fd = int(sys.argv[2])  # the child's argv: its sys.path, its socket's fd, its lifeline's fd
    os.write(sock_fd, worker._HDR.pack(1) + b"(")  # a frame of one byte: a pickle cut short
    return "ok"


# ------------------------------------------------------------------------------------------------- helpers
def running(p: int) -> bool:
    """Whether process p exists and is not a zombie (this container's init does not reap orphans: a killed
    orphan stays 'Z', which is dead)."""
    try:
        stat = Path(f"/proc/{p}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture
def make():
    made = []

    def make_(tools, timeout_s, **kw):
        tp = ToolProcess(tools, timeout_s, **kw)
        made.append(tp)
        tp.start()
        return tp

    yield make_
    for tp in made:
        tp.close()


# --------------------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("tool", [catches_exception, catches_everything])
def test_a_tool_that_swallows_everything_is_killed_at_its_timeout(make, tool):
    tp = make([tool, add], 0.3)
    old = tp.pid
    t0 = time.monotonic()
    text, err = tp.call(tool.__name__, {"seconds": 3.0})
    took = time.monotonic() - t0
    assert (text, err) == (f"error: {tool.__name__} timed out after 0.3 s", "timeout")
    # 0.3 s + the kill and reap when the limit holds; in-process under SIGALRM it ran the whole 3 s: halfway, 1.65 s
    assert took < 1.65
    assert tp.kills == 1
    assert not running(old)
    assert tp.call("add", {"a": 2, "b": 3}) == ("5", "")
    assert tp.pid != old
    assert tp.spawns == 2  # the first process and its replacement


def test_a_timeout_kills_the_processes_and_threads_the_tool_started(make, tmp_path):
    tp = make([starts_processes], 1.0)
    old, pid_file = tp.pid, tmp_path / "pids"
    assert tp.call("starts_processes", {"pid_file": str(pid_file)})[1] == "timeout"
    same, own, orphan = map(int, pid_file.read_text().split())
    assert not running(old)  # the thread died with it
    assert not running(same)  # below the child, in its process group
    assert not running(own)  # setsid'd out of the group: found below the child in /proc
    assert not running(orphan)  # no longer below the child: reached as a member of its group


def test_a_call_from_another_thread_times_out_the_same_way(make):
    tp = make([catches_exception, add], 0.3)
    old, box = tp.pid, {}

    def target():
        t0 = time.monotonic()
        box["answer"] = tp.call("catches_exception", {"seconds": 3.0})
        box["took"] = time.monotonic() - t0

    t = threading.Thread(target=target)
    t.start()
    t.join(10)
    assert box["answer"] == ("error: catches_exception timed out after 0.3 s", "timeout")
    assert box["took"] < 1.65  # halfway between the 0.3 s limit and the 3 s the tool runs unstopped
    assert (tp.kills, running(old)) == (1, False)
    assert tp.call("add", {"a": 1, "b": 1}) == ("2", "")


def test_calls_from_many_threads_are_one_at_a_time(make):
    # 4 threads x 100 calls with distinct arguments: each answer is its own call's sum (interleaved requests on
    # the one socket would cross answers or break a frame).
    tp = make([add], 5.0)
    wrong = []

    def target(k):
        for i in range(100):
            if tp.call("add", {"a": 1000 * k, "b": i}) != (str(1000 * k + i), ""):
                wrong.append((k, i))

    threads = [threading.Thread(target=target, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert wrong == [] and tp.spawns == 1


def test_respawn_on_the_next_call_when_not_early(make):
    tp = make([catches_exception, pid], 0.3, respawn_early=False)
    old = tp.pid
    assert tp.call("catches_exception", {"seconds": 3.0})[1] == "timeout"
    assert (tp.pid, tp.spawns) == (None, 1)  # nothing started until a call needs it
    assert tp.call("pid", {})[0] != str(old)
    assert tp.spawns == 2


# ---------------------------------------------------------------------------------------------------- crashes
def test_a_process_that_dies_is_a_crash_and_the_next_call_gets_a_fresh_one(make):
    tp = make([exits, kills_itself, pid], 5.0)
    first = tp.call("pid", {})[0]
    assert tp.call("exits", {"code": 3}) == (
        "error: exits crashed: its process ended without a reply (exit status 3)",
        "crash",
    )
    second = tp.call("pid", {})[0]
    assert tp.call("kills_itself", {}) == (
        "error: kills_itself crashed: its process ended without a reply (killed by signal 9)",
        "crash",
    )
    third = tp.call("pid", {})[0]
    assert len({first, second, third}) == 3
    assert (tp.spawns, tp.kills) == (3, 0)  # a crash is no timeout


def test_a_reply_over_the_cap_is_a_crash(make):
    tp = make([returns_text, add], 5.0, max_reply_bytes=1000)
    assert tp.call("returns_text", {"n": 500}) == ("x" * 500, "")
    size = len(pickle.dumps(("reply", "x" * 2000, ""), protocol=pickle.HIGHEST_PROTOCOL))  # the child's frame
    assert tp.call("returns_text", {"n": 2000}) == (
        f"error: returns_text crashed: its reply of {size} bytes is over the 1000 byte limit",
        "crash",
    )
    assert tp.call("add", {"a": 1, "b": 1}) == ("2", "")


def test_garbage_in_the_channel_is_a_crash(make):
    tp = make([writes_into_the_channel, add], 5.0)
    assert tp.call("writes_into_the_channel", {}) == (
        "error: writes_into_the_channel crashed: its reply could not be read (EOFError: Ran out of input)",
        "crash",
    )
    assert tp.call("add", {"a": 1, "b": 1}) == ("2", "")
    assert tp.spawns == 2


def test_the_process_dies_with_its_parent(tmp_path):
    # A parent that holds a ToolProcess mid-call is SIGKILLed (no close()): the lifeline pipe's EOF makes the
    # child kill its own group.
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from rl_training.sandbox.tool_process import ToolProcess
        from tests.unit.sandbox.test_tool_process import catches_everything
        tp = ToolProcess([catches_everything], 60.0)
        tp.start()
        print(tp.pid, flush=True)
        tp.call("catches_everything", {"seconds": 60.0})
        """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        child = int(parent.stdout.readline())
        assert running(child)
        parent.kill()
        parent.wait()
        end = time.monotonic() + 5
        while running(child) and time.monotonic() < end:
            time.sleep(0.02)
        assert not running(child)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


# ------------------------------------------------------------------------------------------------- answers
def test_raises_are_answers_and_the_process_survives(make):
    tp = make([boom, unprintable, exiting_str, fails, calls_exit, interrupts, add], 5.0)
    assert tp.call("boom", {}) == ("error: boom raised ValueError: no 5", "raised")  # one_line: 'Type: message'
    text, err = tp.call("unprintable", {})  # one_line names the type (and may add a note)
    assert text.startswith("error: unprintable raised Unprintable") and err == "raised"
    assert tp.call("exiting_str", {}) == ("error: exiting_str raised ExitingStr", "raised")  # its type alone
    assert tp.call("fails", {}) == ("text", "custom")
    assert tp.call("calls_exit", {}) == ("error: calls_exit raised SystemExit: 2", "raised")
    assert tp.call("interrupts", {}) == ("error: interrupts raised KeyboardInterrupt", "raised")
    assert tp.call("add", {"a": 1, "b": 2}) == ("3", "")
    assert tp.spawns == 1


def test_every_return_value_is_rendered_in_the_child(make):
    tp = make([returns], 5.0)
    for kind in ("big_int", "deep_list"):  # past the str limit, past the recursion limit: named, never a crash
        text, err = tp.call("returns", {"kind": kind})
        assert isinstance(text, str) and text and err == ""
    assert tp.call("returns", {"kind": "bytes"}) == ("café \ufffd", "")  # invalid UTF-8 replaced
    assert tp.call("returns", {"kind": "dict"}) == ('{"a": 1}', "")  # JSON
    assert tp.spawns == 1


def test_a_value_the_renderer_fails_on_is_named_by_its_type(monkeypatch):
    # result_text is meant to be total; the child's last resort still answers if it is not (in process here).
    from rl_training.sandbox import tool_worker

    def broken(out):
        raise RecursionError("deep")

    monkeypatch.setattr(tool_worker, "result_text", broken)
    assert tool_worker.run_tool(add, "add", {"a": 1, "b": 2}) == ("<unrenderable int>", "")


def test_arguments_past_the_str_limit_reach_the_tool(make):
    tp = make([digit_count, add], 5.0)
    assert tp.call("digit_count", {"n": 10**4999 + 12345}) == ("5000", "")  # 10**4999 has 5000 digits
    assert tp.call("add", {"a": threading.Lock(), "b": 1}) == (
        "error: add: its arguments cannot be sent to its process (TypeError: cannot pickle '_thread.lock' object)",
        "arguments",
    )


def test_a_tool_that_prints_does_not_touch_the_protocol(make):
    tp = make([prints, add], 5.0)
    assert tp.call("prints", {}) == ("ok", "")
    assert tp.call("add", {"a": 1, "b": 2}) == ("3", "")


# ------------------------------------------------------------------------------------------- construction
def nested_maker():
    def inner(x: int) -> int:
        return x

    return inner


def test_tools_that_cannot_be_imported_by_reference_are_refused():
    for fn, label in ((lambda x: x, "<lambda>"), (nested_maker(), "inner")):
        with pytest.raises(ValueError) as e:
            ToolProcess([fn], 1.0)
        assert str(e.value) == (
            f"tool {label!r} is not importable by reference (a lambda or a function defined inside another): "
            "define it at module level"
        )
    with pytest.raises(ValueError, match="^two tools are named 'add'$"):
        ToolProcess([add, add], 1.0)
    with pytest.raises(KeyError, match="no tool named 'nope'"):
        ToolProcess([add], 1.0).call("nope", {})


def test_a_tool_from_a_users_task_file_runs_in_the_child(make, tmp_path):
    from rl_training.config.plugins import import_file

    path = tmp_path / "my_tools.py"
    path.write_text(
        "import os\n\ndef triple(x: int) -> int:\n    return 3 * x\n\ndef where() -> int:\n    return os.getpid()\n"
    )
    mod = import_file(str(path), "test")
    assert mod.__name__.startswith("rl_user_my_tools_")  # not importable by that name: loaded from the file
    tp = make([mod.triple, mod.where], 5.0)
    assert tp.call("triple", {"x": 2}) == ("6", "")
    assert tp.call("where", {}) == (str(tp.pid), "")


def test_a_tool_defined_in_a_script_runs_without_its_main_block(tmp_path):
    # The child loads the script as __mp_main__: its `if __name__ == "__main__"` block (which would start a
    # second ToolProcess, and so on) does not run there; "main ran" is printed once, by the parent.
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import os

        def where() -> int:
            return os.getpid()

        if __name__ == "__main__":
            from rl_training.sandbox.tool_process import ToolProcess
            print("main ran", flush=True)
            with ToolProcess([where], 5.0) as tp:
                print(tp.call("where", {}) == (str(tp.pid), ""), tp.spawns, flush=True)
        """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout) == (0, "main ran\nTrue 1\n"), out.stderr


def test_a_child_that_cannot_import_a_tool_fails_start_with_one_line(tmp_path):
    from rl_training.config.plugins import import_file

    # The file raises once a marker exists, made after this process imported it: only the child's import fails.
    path, marker = tmp_path / "child_only_error.py", tmp_path / "marker"
    path.write_text(
        "from pathlib import Path\n"
        f"if Path({str(marker)!r}).exists():\n"
        "    raise RuntimeError('only in\\nthe child')\n"
        "def tool() -> int:\n    return 1\n"
    )
    mod = import_file(str(path), "test")
    marker.touch()
    tp = ToolProcess([mod.tool], 5.0)
    with pytest.raises(ValueError) as e:
        tp.start()
    assert str(e.value) == (
        f"the tools' process could not start: tool 'tool': importing {mod.__name__}.tool from {path.resolve()} "
        "raised RuntimeError: only in the child"
    )
    assert tp.pid is None
    tp.close()


# ------------------------------------------------------------------------------------------------------ close
def test_close_leaves_no_process(make):
    tp = make([starts_sleep], 5.0)
    child = tp.pid
    sleep = int(tp.call("starts_sleep", {})[0])
    assert running(child) and running(sleep)
    tp.close()
    tp.close()  # idempotent
    assert not running(child) and not running(sleep)
    assert tp.pid is None
    with pytest.raises(RuntimeError, match="after close"):
        tp.call("starts_sleep", {})
