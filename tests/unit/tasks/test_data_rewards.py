"""Data loading (formats, references, file:line errors), the sampler, and the reward graders."""

from __future__ import annotations

import json
import time

import pytest

from rl_training.data.prompts import PromptSampler, render_prompt
from rl_training.data.sources import DataError, Example, load_examples
from rl_training.tasks.base import Scores, Task, score_completions
from rl_training.tasks.build import make_task
from rl_training.tasks.math import MathTask, last_boxed, math_reward
from rl_training.tasks.reverse import ReverseTask, reverse_reward


def parse(name: str, **args):
    """The record parser of built-in task `name` (what load_examples reads a data file with)."""
    return make_task(name, args).parse


EX = Example("q", "r", "r", "t:1")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_gsm8k_reference_strips_commas(tmp_path):
    p = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "work...\n#### 1,234"}])
    (ex,) = load_examples(str(p), parse("gsm8k"))
    assert ex.reference == "1234" and ex.solution.endswith("#### 1,234") and ex.source == f"{p}:1"


def test_math_reference_is_last_boxed(tmp_path):
    p = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": r"so \boxed{2} and \boxed{\frac{1}{2}}."}])
    (ex,) = load_examples(str(p), parse("math", question_key="problem", answer_key="solution"))
    assert ex.reference == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c" and last_boxed("none") is None
    assert last_boxed(r"\fbox{1} then \boxed{2} then \fbox{ 3 }") == "3"  # the last of either, stripped
    assert last_boxed(r"\boxed{\{1\}} and \boxed{\left\{ x \right\}}") == r"\left\{ x \right\}"
    assert last_boxed(r"\boxed{4} then \boxed{5") == "4"  # an open box is passed over
    assert last_boxed(r"\boxed 4 and \frac{1}{2}") is None  # no brace right after \boxed: no box


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["abc"], "answer": ["cba"]}), tmp_path / "d.parquet")
    (ex,) = load_examples(str(tmp_path / "d.parquet"), parse("reverse"))
    assert (ex.question, ex.reference) == ("abc", "cba")


@pytest.mark.parametrize(
    "rows, fmt, message",
    [
        (['{"question": "a", "answer": "b"}', '{"question": "a", "answer": '], "reverse", r"\.jsonl:2: invalid JSON"),
        ([{"question": "a"}], "reverse", r"\.jsonl:1: missing key 'answer'"),
        (
            [{"question": "a", "answer": "#### 4"}, {"question": "q", "answer": "no final"}],
            "gsm8k",
            r"\.jsonl:2: gsm8k answer has no '#### N'",
        ),
        (["[1, 2]"], "reverse", r"\.jsonl:1: expected a JSON object"),
    ],
)
def test_data_errors_name_file_and_line(tmp_path, rows, fmt, message):
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_examples(str(p), parse(fmt))


def test_missing_data_file():
    with pytest.raises(DataError, match="data file not found: /no/such.jsonl"):
        load_examples("/no/such.jsonl", parse("gsm8k"))


def test_corrupt_parquet_is_one_line_data_error(tmp_path):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"not a parquet file")
    with pytest.raises(DataError) as e:
        load_examples(str(p), parse("reverse"))
    msg = str(e.value)
    assert msg.startswith(f"{p}: unreadable parquet file (ArrowInvalid: ") and "\n" not in msg


@pytest.mark.parametrize(
    "spec, cause",
    [
        ("openai/gsm8kk:main@train", "OfflineModeIsEnabled"),  # a typo'd hub name (or one not in the cache)
        ("{tmp}/no/such/dir@train", "FileNotFoundError"),  # a local dataset directory that does not exist
        ("{tmp}/ds@test", "Unknown split"),  # a local `datasets` directory without that split
        ("{tmp}/bad@train", "ArrowInvalid"),  # a `datasets` directory whose parquet file is corrupt
    ],
)
def test_datasets_load_errors_are_one_line(tmp_path, monkeypatch, spec, cause):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # never reach for the network, even if there is one
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"question": ["abc"], "answer": ["cba"]}), tmp_path / "ds" / "train.parquet")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.parquet").write_bytes(b"not a parquet file")
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(DataError) as e:
        load_examples(spec, parse("reverse"))
    msg = str(e.value)
    assert msg.startswith(f"data spec '{spec}' is not a local .jsonl/.json/.parquet file and `datasets` cannot")
    assert cause in msg and "\n" not in msg
    # The same directory read correctly, so the errors above are about the spec, not the machinery.
    assert load_examples(f"{tmp_path}/ds@train", parse("reverse"))[0].reference == "cba"


def test_render_prompt_keeps_latex_braces():
    assert render_prompt(r"Find \frac{1}{2}", "Q: {question}\nA:") == "Q: Find \\frac{1}{2}\nA:"


def test_the_prompt_format_belongs_to_the_task_and_the_chat_template_to_the_tokenizer():
    """Issue 48: no "=" after a task that did not ask for it; auto = the chat template where the tokenizer has one."""
    from rl_training.config.load import load_config
    from rl_training.policy.tiny_model import build_tokenizer

    data = load_config(None).data
    ex = Example("abc", "cba")
    plain, chat = build_tokenizer(), build_tokenizer(chat=True)
    assert data.prompt_template == "" and data.use_chat_template == "auto"
    assert make_task("reverse").render_prompt(ex, plain, data) == "abc="  # the reverse demo's own format
    assert make_task("gsm8k").render_prompt(ex, plain, data) == "abc"  # no '=' for any other task
    # auto: the chat tokenizer's template, with the task's format as the user turn; the plain one has none
    assert (
        make_task("gsm8k").render_prompt(ex, chat, data) == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    )
    assert make_task("reverse").render_prompt(ex, chat, data).startswith("<|im_start|>user\nabc=<|im_end|>")
    off = load_config(None, ["data.use_chat_template=false", "data.prompt_template=Q: {question}"]).data
    assert make_task("reverse").render_prompt(ex, chat, off) == "Q: abc"  # the config's template wins
    on = load_config(None, ["data.use_chat_template=true"]).data
    with pytest.raises(DataError, match="data.use_chat_template=true but the tokenizer of .* has no chat template"):
        make_task("gsm8k").render_prompt(ex, plain, on)


def test_sampler_shards_are_disjoint_and_deterministic():
    s = PromptSampler(n=103, prompts_per_step=8, group_size=4, world_size=2, seed=5)
    assert s.steps_per_epoch == 12  # 103 // 8, the remainder of each epoch is dropped
    for step in (0, 5, 11, 12, 30):
        r0, r1 = s.indices(step, 0), s.indices(step, 1)
        assert len(r0) == len(r1) == 4 and not set(r0) & set(r1)
        assert r0 == PromptSampler(103, 8, 4, 2, 5).indices(step, 0)  # a pure function of (seed, step, rank)
    epoch0 = [i for step in range(12) for r in (0, 1) for i in s.indices(step, r)]
    assert len(set(epoch0)) == 96  # no prompt twice within an epoch
    assert s.indices(12, 0) != s.indices(0, 0)  # a new permutation each epoch
    assert s.position(13) == (1, 8)


def test_repeated_questions_are_dropped_keeping_the_first():
    from rl_training.data.prompts import dedupe_questions
    from rl_training.data.sources import Example

    exs = [Example(q, a, a, f"f:{i + 1}") for i, (q, a) in enumerate([("a", "1"), ("b", "2"), ("a", "3"), ("c", "4")])]
    kept, n = dedupe_questions(exs)
    assert n == 1 and [e.source for e in kept] == ["f:1", "f:2", "f:4"]  # line 3 repeats line 1's question
    # an environment's problem is its question and reference: one prompt text hides several secrets
    from rl_training.tasks import Environment, Task

    kept, n = dedupe_questions([*exs, exs[0]], Environment().problem_key)
    assert n == 1 and [e.source for e in kept] == ["f:1", "f:2", "f:3", "f:4"]
    assert dedupe_questions(exs, Task().problem_key) == dedupe_questions(exs)


def test_sampler_rejects_tiny_dataset():
    with pytest.raises(DataError, match="dataset has 3 prompts < rollout.prompts_per_step=4"):
        PromptSampler(3, 4, 2, 1, 0)


# ------------------------------------------------------------------------------------------------ rewards
@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        ("cba", "cba", 1.0),
        ("cbx", "cba", 2 / 3),  # 2 of 3 positions match
        ("cb", "cba", 2 / 3),  # missing char: 2 matches / max(2, 3)
        ("cbaa", "cba", 3 / 4),  # extra char: 3 matches / max(4, 3)
        ("", "cba", 0.0),
        (" cba\n", "cba", 1.0),  # surrounding whitespace is ignored
    ],
)
def test_reverse_reward(pred, ref, expected):
    assert reverse_reward(pred, ref) == pytest.approx(expected)


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        (r"The answer is \boxed{72}.", "72", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{73}", "72", 0.0),
        ("I don't know", "72", 0.0),
    ],
)
def test_math_reward(completion, reference, expected):
    assert math_reward(completion, reference) == expected


class Flaky(Task):
    """A user reward that raises, hangs, returns NaN or a string: each scores 0 and is counted."""

    correct_threshold = 0.5

    def reward(self, c, example):
        if c == "raise":
            raise RuntimeError("boom")
        if c == "slow":
            time.sleep(5)
        if c == "nan":
            return float("nan")
        if c == "str":
            return "high"
        return 0.75


class Fussy(Task):
    correct_threshold = 0.5

    def reward(self, c, example):
        return 1.0

    def has_answer(self, c):
        return c.startswith("ok") or 1 / 0


def test_failing_reward_functions_score_zero_and_are_counted():
    t0 = time.perf_counter()
    s = score_completions(Flaky(), ["ok", "raise", "slow", "nan", "str", "ok"], [EX] * 6, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2.0  # the slow call was cut at its 0.2 s limit
    assert s.rewards == [0.75, 0.0, 0.0, 0.0, 0.0, 0.75]
    assert (s.errors, s.timeouts, s.invalid) == (1, 1, 2)
    assert s.correct == [True, False, False, False, False, True]
    # A format check that raises counts the completion as unformatted and never stops the run either.
    assert score_completions(Fussy(), ["ok", "bad"], [EX, EX], timeout_s=0.2).formatted == [True, False]


class BatchGraded(Task):
    """grade() over the whole batch: one call, and what it returns is checked."""

    part_names = ("pass_frac",)
    count_names = ("fail_syntax", "fail_timeout")

    def __init__(self):
        self.calls = []

    def grade(self, completions, examples, timeout_s):
        self.calls.append(len(completions))
        if completions[0] == "raise":
            raise RuntimeError("pool died")
        n = len(completions)
        rewards = [1.0, float("nan"), 0.25][:n]
        # 'extra' is not a declared part: dropped; 'pass_frac' declared: kept; 'fail_timeout' missing: 0
        parts = {"pass_frac": [1.0, 0.5, 0.25][:n], "extra": [9.0] * n}
        return Scores(rewards, [False] * n, [True] * n, 0, 1, 0, parts, {"fail_syntax": 2})


def test_batch_grader_grades_the_batch_once_and_is_checked():
    task = BatchGraded()
    exs = [Example("q", "r", "r", "t:1", meta={"tests": ["assert f(1) == 1"]})] * 3
    s = score_completions(task, ["a", "b", "c"], exs, timeout_s=1.0)
    assert task.calls == [3]  # one call for the batch
    assert s.rewards == [1.0, 0.0, 0.25] and s.invalid == 1 and s.timeouts == 1  # nan -> 0, counted
    assert s.correct == [True, False, False]  # the task's threshold (1.0), not the grader's verdicts
    assert s.parts == {"pass_frac": [1.0, 0.5, 0.25]}
    assert s.counts == {"fail_syntax": 2.0, "fail_timeout": 0.0}
    # A raising grader: every completion 0 and counted, with the declared names still present (zeros), so
    # every rank reduces the same metric keys.
    s = score_completions(task, ["raise", "b"], exs[:2], timeout_s=1.0)
    assert s.rewards == [0.0, 0.0] and s.errors == 2
    assert s.parts == {"pass_frac": [0.0, 0.0]} and s.counts == {"fail_syntax": 0.0, "fail_timeout": 0.0}
    with pytest.raises(ValueError, match="3 completions for 2 examples"):
        score_completions(task, ["a", "b", "c"], exs[:2], timeout_s=1.0)
    # one completion's reward goes through the batch grader; a task with neither says so
    assert task.reward("a", exs[0]) == 1.0 and task.calls[-1] == 1
    with pytest.raises(NotImplementedError, match="Task defines neither reward"):
        Task().reward("a", exs[0])


def test_builtin_tasks_grade_with_the_pure_graders():
    # math: a boxed 72 against '#### 72' (reference 72) is 1 by math_reward; reverse: 2 of 3 positions
    gsm, rev = make_task("gsm8k"), make_task("reverse")
    assert isinstance(gsm, MathTask) and isinstance(rev, ReverseTask)
    (ex,) = [gsm.parse({"question": "q", "answer": "#### 72"}, "f:1")]
    assert gsm.reward(r"\boxed{72}", ex) == math_reward(r"\boxed{72}", "72") == 1.0
    assert rev.reward("cbx", Example("abc", "cba")) == reverse_reward("cbx", "cba") == pytest.approx(2 / 3)
