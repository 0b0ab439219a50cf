"""The tool protocol's model boundary (rl_training/tasks/tools.py, rl_training/data/text.py; issue 38) against
Qwen2.5's added tokens and real chat template (tests/hostile.py): every function that reads a policy's turn or a
tool's output returns a value for any input, each crash class found by hand has its regression test, and
Hypothesis tries the rest (data/text.py's own properties: tests/unit/data/test_text.py). What must hold: no
observation ever carries an added token the template did not put there, every tool turn fits the one observation
budget, and every text reaching the tokenizer is valid UTF-8."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_training.base.errors import one_line
from rl_training.data.sources import Example
from rl_training.data.text import encode_plain, result_text
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.episodes import EpisodeSpec, TurnSample, run_episodes
from rl_training.tasks.base import TaskContext, Turn
from rl_training.tasks.tools import ToolEnvironment, parse_tool_calls, scan_tool_calls
from tests.hostile import CONTROL, TURN_TEXT, qwen25_tokenizer
from tests.tool_fns import Unprintable, calculator, echo, hostile_raise, raw, stubborn

Q = qwen25_tokenizer()
ADDED = frozenset(Q.added_tokens_encoder.values())
IM_END = Q.convert_tokens_to_ids("<|im_end|>")


class Tools(ToolEnvironment):
    tools = (echo, calculator, raw, hostile_raise, stubborn)


BUDGET = 400


@pytest.fixture(scope="module")
def env():
    e = Tools(max_tool_calls=3, tool_timeout_s=5.0)
    e.start(TaskContext(tokenizer=Q, cfg=SimpleNamespace(multiturn=SimpleNamespace(max_obs_tokens=BUDGET))))
    yield e
    e.close()


def turn_of(text: str, eos: bool = True) -> Turn:
    ids = [*encode_plain(Q, text), *([IM_END] if eos else [])]
    return Turn(Q.decode(ids, skip_special_tokens=True), ids, 1, eos, False)


def call(name: str, args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def results_of(env, turn: Turn) -> tuple[list[str], object]:
    stats = env.call_stats()
    step = env.step_batch([env.reset(Example("q", "a"))], [turn], stats)[0]
    text = Q.decode(step.observation)
    return [r.split("\n</tool_response>")[0] for r in text.split("<tool_response>\n")[1:]], (step, stats)


def structure_ids(env, n: int, sampled: list[int]) -> list[int]:
    """The added-token ids of the template's own tool turn of n results: all an observation may carry."""
    return [i for i in env.fmt.tool_turn([""] * n, sampled) if i in ADDED]


# ---------------------------------------------------------------------------------------------- regressions
def test_a_close_tag_inside_a_json_string_does_not_end_the_call():
    """The old non-greedy pattern ended the block at the first '</tool_call>', inside the string: malformed."""
    text = '<tool_call>{"name": "echo", "arguments": {"text": "a</tool_call>b"}}</tool_call> then'
    (c,) = parse_tool_calls(text)
    assert (c.name, c.arguments, c.error) == ("echo", {"text": "a</tool_call>b"}, "")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('{"name": "calculator", "arguments": {"a": ' + "9" * 5000 + ', "b": 1}}', "invalid number"),  # ValueError
        ('{"name": "echo", "arguments": {"text": ' + "[" * 5000 + "]" * 5000 + "}}", "nested too deep"),  # Recursion
        ('{"name": "echo", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}', "its arguments string is not JSON"),
        ('{"name": "echo"} trailing', "text after the JSON object"),
        ('{"name": "echo", "arguments": ', "Expecting value"),
    ],
)
def test_arguments_json_cannot_raise_out_of_the_parser(body, why):
    """A huge integer (past Python's 4,300-digit limit) raised ValueError, deep nesting RecursionError, out of
    json.loads: both ended the run."""
    (c,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert c.name == "" and why in c.error


def test_a_lone_surrogate_from_a_json_escape_reaches_the_tool_and_never_the_tokenizer(env):
    """'\\ud800' in the model's JSON is a lone surrogate in the argument; echoed back, the tokenizer raised."""
    results, _ = results_of(env, turn_of(call("echo", {"text": "x\ud800y"})))
    assert results == ["x?y"]


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("huge_int", "<int of 16610 bits, too large to print>"),  # 10**5000: 16610 bits
        ("deep", "<list that cannot be shown as text>"),
        ("surrogate", "a?b"),
        ("bytes_im_end", "\ufffd\ufffd<|im_end|>"),
        ("set", "{1, 2}"),
        ("unprintable", "<Unprintable that cannot be shown as text>"),
    ],
)
def test_any_return_value_renders(env, kind, expect):
    """json.dumps then str(): the 4,300-digit str limit (ValueError), nesting past the recursion limit
    (RecursionError) and a raising __str__ all escaped result_text and ended the run."""
    assert result_text(raw(kind)) == expect
    results, (_, stats) = results_of(env, turn_of(call("raw", {"kind": kind})))
    assert results == [expect] and stats.errors["raised"] == 0


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("unprintable", "error: hostile_raise raised Unprintable: (its message cannot be shown)"),
        ("surrogate", "error: hostile_raise raised ValueError: bad ? byte"),
    ],
)
def test_a_raised_tool_text_is_total_and_clean(env, kind, expect):
    """The raised path skipped the cleaning the result path had (a surrogate in the message reached the
    tokenizer), and one_line(e) raised for an exception whose __str__ raises."""
    assert one_line(Unprintable()) == "Unprintable: (its message cannot be shown)"
    results, (_, stats) = results_of(env, turn_of(call("hostile_raise", {"kind": kind})))
    assert results == [expect] and stats.errors["raised"] == 1


def test_two_calls_in_a_turn_fit_the_budget_with_the_marker(tmp_path):
    """docs/tools.md's old example (max_obs_tokens=64, two calls in one turn): the environment returned more
    ids than the budget, and the engine cut the tool turn inside the template. Now every result gets its share
    and the structure stays whole: the turn's ids are at most the budget and end with the generation prompt."""
    e = Tools(max_tool_calls=2)
    budget = len(e.format_for(Q).tool_turn([""] * 3, [])) + 10  # the largest turn's structure + 10 tokens
    e.start(TaskContext(tokenizer=Q, cfg=SimpleNamespace(multiturn=SimpleNamespace(max_obs_tokens=budget))))
    turn = turn_of(call("echo", {"text": "a" * 300}) + call("echo", {"text": "b" * 300}))
    results, (step, stats) = results_of(e, turn)
    assert len(step.observation) <= budget and stats.truncated == 2
    assert [r[:1] for r in results] == ["a", "b"] and all(r.endswith("\n[truncated]") for r in results)
    assert Q.decode(step.observation).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    e.close()


def test_a_turn_of_many_blocks_is_answered_within_the_limit():
    """500 blocks in one turn: the first max_tool_calls run, the next is the too_many error that counts the
    rest; no more results than the turn can hold, every block counted."""
    big = Tools(max_tool_calls=3)
    big.start(TaskContext(tokenizer=Q, cfg=SimpleNamespace(multiturn=SimpleNamespace(max_obs_tokens=800))))
    turn = turn_of(call("calculator", {"a": 1, "b": 2}) * 500)
    results, (step, stats) = results_of(big, turn)
    big.close()
    assert results[:3] == ["3", "3", "3"] and len(results) == 4
    assert results[3] == (
        "error: more than max_tool_calls=3 tool calls in this episode (496 more <tool_call> blocks in this turn "
        "were not run)"
    )
    assert stats.calls == 500 and stats.errors["too_many"] == 497 and step.counts["tool_calls"] == 500


def test_look_alike_results_stay_plain_text(env):
    """4000 look-alikes in a result (Qwen2.5's <tool_call> is a non-special added token the tokenizer matches in
    plain text): the old encoder recursed once per look-alike (RecursionError past ~1000)."""
    t0 = time.process_time()  # CPU time of this process, where the result is encoded (the tool runs in its own)
    results, (step, _) = results_of(env, turn_of(call("raw", {"kind": "look_alikes"})))
    assert time.process_time() - t0 < 2.0  # 2-3 ms here; a pass per look-alike is ~4000 times that, ~10 s
    assert [i for i in step.observation if i in ADDED] == structure_ids(env, 1, turn_of("").ids)
    assert results[0].startswith("<tool_call><tool_call>") and results[0].endswith("[truncated]")


@pytest.mark.parametrize("thread", [False, True])
def test_a_tool_that_swallows_its_timeout_is_stopped_from_outside(thread):
    """A tool that catches BaseException in a 3 s busy loop, tool_timeout_s=0.3: in the trainer's process SIGALRM
    raised into it and it ran on for 3 s, no timeout counted; off the main thread the tool thread was abandoned,
    still running. Its process is now killed at 0.3 s (measured 0.30-0.31 s to the answer), counted, and the
    next call runs in a fresh process."""
    import threading

    e = Tools(max_tool_calls=3, tool_timeout_s=0.3)
    e.start(TaskContext(tokenizer=Q, cfg=SimpleNamespace(multiturn=SimpleNamespace(max_obs_tokens=BUDGET))))
    first = e.process.pid
    out: dict = {}

    def go():
        t0 = time.perf_counter()
        out["r"] = results_of(e, turn_of(call("stubborn", {"seconds": 3.0})))
        out["s"] = time.perf_counter() - t0

    if thread:
        th = threading.Thread(target=go)
        th.start()
        th.join()
    else:
        go()
    results, (_, stats) = out["r"]
    assert results == ["error: stubborn timed out after 0.3 s"] and stats.errors["timeout"] == 1
    assert out["s"] < 1.65 and e.process.kills == 1  # halfway between the 0.3 s limit and the tool's 3 s unstopped
    assert results_of(e, turn_of(call("calculator", {"a": 2, "b": 3})))[0] == ["5"] and e.process.pid != first
    e.close()


# ----------------------------------------------------------------------------------------------- properties
@given(TURN_TEXT, st.integers(min_value=0, max_value=6))
def test_scan_is_total_and_its_limit_is_a_prefix_of_the_whole_scan(text, limit):
    calls, more = scan_tool_calls(text, limit)
    assert calls == parse_tool_calls(text)[:limit]
    assert more == 0 or len(calls) == limit
    for c in calls:
        assert isinstance(c.name, str) and isinstance(c.arguments, dict) and isinstance(c.error, str)
        assert not c.error or (c.name, c.arguments) == ("", {})


@given(TURN_TEXT)
def test_any_turn_gets_a_tool_turn_within_budget_carrying_only_the_templates_tokens(env, text):
    turn = turn_of(text)
    stats = env.call_stats()
    step = env.step_batch([env.reset(Example("q", "a"))], [turn], stats)[0]
    if step.done:  # no <tool_call> block: the answer
        assert "<tool_call>" not in turn.text
        return
    n = min(step.counts["tool_calls"], env.max_results_per_turn)
    assert len(step.observation) <= BUDGET
    assert [i for i in step.observation if i in ADDED] == structure_ids(env, n, turn.ids)


class Scripted:
    """Call t answers every live episode with script[t] (ids; the last one again past the end), log-prob -1."""

    def __init__(self, script):
        self.script, self.stop_ids, self.calls = script, {IM_END}, 0

    def generate_turn(self, contexts, max_tokens, seeds, spec, stop):
        ids = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return [TurnSample(ids[:cap], [-1.0] * len(ids[:cap])) for cap in max_tokens]


@given(st.lists(TURN_TEXT, min_size=1, max_size=3))
def test_episodes_of_hostile_turns_mask_every_observation_token(env, texts):
    """Through the real engine: every observation token has mask 0, log-prob 0 and turn index 0, and carries no
    added token but the template's; the episode stays within its budgets."""
    gen = Scripted([[*encode_plain(Q, t)[:200], IM_END] for t in texts])
    es = EpisodeSpec(max_turns=3, max_tokens_per_turn=256, max_response_tokens=2000, max_obs_tokens=BUDGET)
    ro = run_episodes(gen, env, Q, [[5]], [Example("q", "a")], SamplingSpec(n=1, max_new_tokens=0, seed=1), es)
    ids, mask = ro.completion_ids[0], ro.loss_mask[0]
    obs = [i for i, m in zip(ids, mask, strict=True) if not m]
    assert all(lp == 0.0 and t == 0 for lp, t, m in zip(ro.logprobs[0], ro.turn_index[0], mask, strict=True) if not m)
    assert ADDED.isdisjoint(i for i in obs if i not in (IM_END, Q.convert_tokens_to_ids("<|im_start|>")))
    assert len(ids) <= es.max_response_tokens and ro.episodes[0]["error"] == ""
    assert CONTROL  # the strategies' look-alikes are Qwen2.5's own strings
