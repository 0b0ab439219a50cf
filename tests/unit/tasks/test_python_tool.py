"""The python tool environment (rl_training/tasks/python_tool.py) with the real sandbox pool and the tiny chat
tokenizer: output as the tool result, state kept within an episode (replayed cells) and never across episodes,
the timeout, memory, crash and hostile programs as counted observations, output truncation, the final answer
graded by the math grader, a scripted episode through the real episode engine, and the registry's task.args."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from rl_training.config.schema import ConfigError, SandboxCfg
from rl_training.data.sources import Example
from rl_training.data.text import encode_plain
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.episodes import EpisodeSpec, TurnSample, run_episodes
from rl_training.tasks.base import TaskContext, Turn
from rl_training.tasks.build import make_task
from rl_training.tasks.python_tool import NO_OUTPUT, PERSIST_NOTE, PythonToolEnvironment
from tests.helpers import metered, require_debian_packages

IM_START, IM_END = 258, 259  # the chat variant's special ids (tiny_model.py)
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(chat=True)


@pytest.fixture(scope="module")
def ctx(tok):
    """A run context whose sandbox has 2 workers; each environment of the module starts a pool of its own, closed
    with the module."""
    require_debian_packages({"bwrap": "bubblewrap"})
    yield TaskContext(tokenizer=tok, cfg=SimpleNamespace(sandbox=SandboxCfg(workers=2)))
    while STARTED:
        STARTED.pop().close()


STARTED: list[PythonToolEnvironment] = []


def env_for(ctx, **kw) -> PythonToolEnvironment:
    env = PythonToolEnvironment(**kw)
    env.start(ctx)
    STARTED.append(env)
    return env


def py(code: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": {json.dumps(code)}}}}}</tool_call>'


def sampled(tok, text: str) -> Turn:
    ids = [*encode_plain(tok, text), IM_END]
    return Turn(tok.decode(ids, skip_special_tokens=True), ids, 1, True, False)


def results(tok, step) -> list[str]:
    """The tool results of a step's observation (the text between the template's response tags)."""
    text = tok.decode(step.observation)
    return [r.split("\n</tool_response>")[0] for r in text.split("<tool_response>\n")[1:]]


def run(env, tok, eps, texts, stats=None):
    stats = stats or env.call_stats()
    steps = env.step_batch(eps, [sampled(tok, t) for t in texts], stats)
    return [results(tok, s) for s in steps], stats


# ------------------------------------------------------------------------------------------------- output, state
def test_a_print_comes_back_and_state_persists_within_an_episode_never_across(ctx, tok):
    env = env_for(ctx)
    assert env.schemas[0]["function"]["description"].endswith(PERSIST_NOTE)
    a, b = env.reset(Example("q", "42")), env.reset(Example("q", "42"))
    # one batch, two episodes (run in parallel over the pool): a defines x, b has never seen it
    out, stats = run(env, tok, [a, b], [py("x = 6 * 7\nprint(x)"), py("print(x)")])
    assert out[0] == ["42\n"]
    assert out[1] == ['Traceback (most recent call last):\n  File "<cell 1>", line 1, in <module>\n'
                      "NameError: name 'x' is not defined\n"]  # fmt: skip
    step = env.step_batch([a], [sampled(tok, py("print(x + 1)"))], stats)[0]
    assert tok.decode(step.observation) == TOOL_TURN.format("43\n")  # the whole tool turn, exactly
    # a cell that raised is not replayed (y is gone); two calls in one turn run in order, the second after the first
    out, _ = run(env, tok, [a], [py("y = 1\n1/0") + py("print(x, 'y' in globals())")], stats)
    assert out[0][0].endswith("ZeroDivisionError: division by zero\n") and out[0][1] == "42 False\n"
    assert a.cells == ["x = 6 * 7\nprint(x)", "print(x + 1)", "print(x, 'y' in globals())"] and b.cells == []
    m = metered(stats)
    assert (m["tool/calls"], m["tool/errors_raised"], m["tool/errors_timeout"]) == (5.0, 2.0, 0.0)
    # a fresh episode starts from nothing, whatever the worker ran before
    assert run(env, tok, [env.reset(Example("q", "1"))], [py("print(sorted(k for k in globals() if k[0] != '_'))")])[
        0
    ] == [["[]\n"]]


def test_without_persistence_every_call_starts_empty(ctx, tok):
    env = env_for(ctx, persist=False)
    assert PERSIST_NOTE not in env.schemas[0]["function"]["description"]
    ep = env.reset(Example("q", "1"))
    out, _ = run(env, tok, [ep], [py("x = 1") + py("print(x)")])
    assert out[0][0] == NO_OUTPUT and out[0][1].endswith("NameError: name 'x' is not defined\n")
    assert ep.cells == []


def test_output_is_cut_to_output_chars_keeping_both_ends(ctx, tok):
    env = env_for(ctx, output_chars=20)
    out, stats = run(env, tok, [env.reset(Example("q", "1"))], [py("print('a' * 100)") + py("print('b' * 500)\n1/0")])
    # 101 characters ('a' * 100 + newline): the first 10 and the last 10 kept, 81 cut
    assert out[0][0] == "aaaaaaaaaa\n[output truncated: 81 of 101 characters cut]\naaaaaaaaa\n"
    # 'b' * 500 + newline + the 110-character traceback: 611, of which the tail keeps the error's last 10
    assert out[0][1] == "bbbbbbbbbb\n[output truncated: 591 of 611 characters cut]\nn by zero\n"
    assert stats.truncated == 0  # both fit max_obs_tokens: only output_chars cut them


# ----------------------------------------------------------------------------------------- failures go on
def test_an_endless_loop_times_out_counted_and_the_episode_goes_on(ctx, tok):
    env = env_for(ctx, tool_timeout_s=1.0)
    ep = env.reset(Example("q", "1"))
    t0 = time.perf_counter()
    stats = env.call_stats()
    step = env.step_batch([ep], [sampled(tok, py("x = 5\nwhile True:\n    pass"))], stats)[0]
    assert time.perf_counter() - t0 < 3.0
    assert results(tok, step) == ["error: python timed out after 1 s"]
    assert step.counts == {"tool_calls": 1, "tool_errors": 1, "used_tools": 1.0} and not step.done
    m = metered(stats)
    assert (m["tool/errors_timeout"], m["tool/timeouts"], m["tool/calls"]) == (1.0, 1.0, 1.0)
    out, _ = run(env, tok, [ep], [py("print('x' in globals())")], stats)
    assert out == [["False\n"]] and ep.cells == ["print('x' in globals())"]  # the timed-out cell is not kept


HOSTILE = {  # name: (code, error class, the result's last line)
    "fork_bomb": (
        "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(60)",
        "raised",
        "BlockingIOError: [Errno 11] Resource temporarily unavailable",
    ),
    "shadow": (
        "print(open('/etc/shadow').read())",
        "raised",
        "FileNotFoundError: [Errno 2] No such file or directory: '/etc/shadow'",
    ),
    "network": (
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
        "raised",
        "OSError: [Errno 101] Network is unreachable",
    ),
    "memory": ("x = ' ' * (2 << 30)", "memory", "error: python ran out of memory (limit 1024 MiB)"),
    "exit": (
        "import os\nos._exit(3)",
        "crash",
        "error: python crashed: its process ended without a reply (exit status 3)",
    ),
    "killed": (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        "crash",
        "error: python crashed: its process ended without a reply (killed by signal 9)",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_get_an_error_result_and_the_run_goes_on(ctx, tok, name):
    env = env_for(ctx)
    code, cls, last = HOSTILE[name]
    ep = env.reset(Example("q", "1"))
    out, stats = run(env, tok, [ep], [py(code)])
    assert out[0][0].rstrip("\n").split("\n")[-1] == last
    m = metered(stats)
    assert m[f"tool/errors_{cls}"] == 1.0 and sum(v for k, v in m.items() if k.startswith("tool/errors_")) == 1.0
    assert run(env, tok, [ep], [py("print(6 * 7)")], stats)[0] == [["42\n"]]  # the same episode, the next call


# ------------------------------------------------------------------------------------------------- grading
def test_the_final_answer_is_graded_by_the_math_grader():
    env = PythonToolEnvironment(fmt="gsm8k")
    ex = env.parse({"question": "What is 1234 + 0?", "answer": "1234 + 0 = 1234\n#### 1,234"}, "rec 1")
    assert ex.reference == "1234"
    call = py("print(1234 + 0)")
    assert env.reward(f"{call}The sum is \\boxed{{1,234}}.", ex) == 1.0
    assert env.reward(f"{call}The sum is \\boxed{{1235}}.", ex) == 0.0
    # only the text after the last call counts: an answer inside the code is not the final answer
    assert env.reward(py("print('\\\\boxed{1234}')") + "Done.", ex) == 0.0
    assert env.has_answer(f"{call}\\boxed{{7}}") and not env.has_answer(py("'\\\\boxed{7}'") + "no answer")
    assert env.answer_classes([f"{call}\\boxed{{2}}", "\\boxed{2.0}", f"{call}none"]) == [0, 0, None]


class Scripted:
    """A TurnGenerator answering turn t of every episode with script[t-1][i] (ids), log-prob -0.5 each."""

    def __init__(self, script):
        self.script, self.calls, self.stop_ids = script, 0, {IM_END}

    def generate_turn(self, contexts, max_tokens, seeds, spec, stop):
        self.calls += 1
        return [TurnSample(s, [-0.5] * len(s)) for s in self.script[self.calls - 1][: len(contexts)]]


class Data:
    prompt_template, system_prompt = "{question}", "Use python. Put the answer in \\boxed{}."


def test_a_two_call_episode_through_the_engine_is_graded_on_its_final_answer(ctx, tok):
    env = env_for(ctx)
    ex = Example("What is 6 * 7 + 1?", "43")
    prompt = tok(env.render_prompt(ex, tok, Data), add_special_tokens=False).input_ids
    turns = [py("x = 6 * 7\nprint(x)"), py("print(x + 1)"), "So it is \\boxed{43}."]
    script = [[[*encode_plain(tok, t), IM_END]] for t in turns]
    ro = run_episodes(
        Scripted(script), env, tok, [prompt], [ex], SamplingSpec(n=1, max_new_tokens=0), EpisodeSpec(max_turns=4)
    )
    ids, mask = ro.completion_ids[0], ro.loss_mask[0]
    # trainable: the three sampled turns only; the rest is the two tool turns with the sandbox's outputs
    assert [t for t, m in zip(ids, mask, strict=True) if m] == script[0][0] + script[1][0] + script[2][0]
    obs = [t for t, m in zip(ids, mask, strict=True) if not m]
    assert tok.decode(obs) == TOOL_TURN.format("42\n") + TOOL_TURN.format("43\n")
    assert ro.texts[0] == "".join(turns) and env.reward(ro.texts[0], ex) == 1.0
    assert (ro.episodes[0]["turns"], ro.episodes[0]["tool_calls"], ro.episodes[0]["tool_errors"]) == (3, 2, 0)


# ------------------------------------------------------------------------------------------------ registry
def test_registered_with_its_task_args_and_closes_its_pool(ctx):
    env = make_task("python_math", {"max_tool_calls": 2, "tool_timeout_s": 3.0, "output_chars": 256, "persist": False})
    assert isinstance(env, PythonToolEnvironment) and env.math.fmt == "math"
    assert (env.max_tool_calls, env.tool_timeout_s, env.output_chars, env.persist) == (2, 3.0, 256, False)
    assert make_task("python_gsm8k").math.fmt == "gsm8k"
    with pytest.raises(ConfigError, match="task.args=.*output_chars must be >= 1"):
        make_task("python_math", {"output_chars": 0})
    env.start(ctx)
    assert env.pool is not None and env.pool.size == 2
    env.close()
    assert env.pool is None


def test_a_batch_larger_than_the_pool_keeps_each_episodes_results_and_needs_start(ctx, tok):
    env = env_for(ctx)
    eps = [env.reset(Example("q", str(i))) for i in range(5)]  # 5 episodes over 2 workers
    out, stats = run(env, tok, eps, [py(f"v = {i}") + py("print(v * 10)") for i in range(5)])
    assert out == [[NO_OUTPUT, f"{i * 10}\n"] for i in range(5)] and stats.calls == 10
    with pytest.raises(RuntimeError, match="before start"):
        PythonToolEnvironment().step_batch([eps[0]], [sampled(tok, py("1"))], stats)
