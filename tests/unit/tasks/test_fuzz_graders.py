"""The graders and answer extractors at the model boundary are total (issue 38): for any text a policy writes they
return a value of the right type, or a counted failure, never an exception, and they read a long input in linear
time. Hypothesis states each property over tests/hostile.py's strategies and this file's own shapes (runs of a
look-alike, unclosed boxes, fences and tags, braces 1000 deep, huge numbers); one plain regression test per crash
or slowness class found.

Time bounds: every call on the 20,000-character inputs below takes at most about 22 ms of CPU once fixed (the
slowest: math_answer on '\\boxed{<answer>' + '1.\\{' repeated, measured over 3,000 draws of LONG_TEXT); the quadratic
scans fixed here took 1-15 s on the regression tests' inputs. The bound, 0.5 s, is on the calling thread's CPU time
(elapsed), the least of 2 calls: a machine so busy that a call waits for its core (CI's other lane runs vLLM
beside this tier) adds wall time, not CPU time, and wall time failed this bound there once.
"""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager
from fractions import Fraction
from unittest import mock

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from rl_training.data.sources import Example
from rl_training.tasks import math as math_task
from rl_training.tasks.base import RewardTimeout, Scores, Task, finite_reward, guarded, score_completions
from rl_training.tasks.code.extract import function_continuation, has_code, last_fenced_block, program_for
from rl_training.tasks.math import (
    MathTask,
    last_boxed,
    math_answer,
    math_answer_classes,
    math_has_answer,
    normalise_answer,
)
from rl_training.tasks.reverse import ReverseTask, reverse_has_answer, reverse_reward
from rl_training.tasks.search.reward import exact_match, last_answer, normalize_answer, search_reward, substring_match
from rl_training.tasks.search.task import parse_action, search_answer_classes
from tests.hostile import CONTROL, HOSTILE_TEXT, PIECES, RETURN_VALUES, SURROGATES, TURN_TEXT, Unprintable

TIME_BOUND_S = 0.5  # per call on a 20,000-character input (module docstring)
LONG = 20_000

# ------------------------------------------------------------------------------------------------ strategies
# What the graders look for, and its near misses: a policy repeats any of them thousands of times.
LOOKALIKES = [
    *CONTROL, "\\boxed{", "\\boxed {", "\\fbox{", "\\boxed", "{", "}", "\\{", "\\}", "\\", "#### ", "####\n",
    " ", "\t", "\n", "1", "1 ", "1,", "1.", "1\\,", "1\\hspace{", "\\text{", "a", "aa ", "$", "%", "1 1/",
    "```\n", "``` \t", "```py", "<answer>x", "<search>x</answer>", "</answer>",
]  # fmt: skip
RUNS = st.builds(lambda piece, n: piece * n, st.sampled_from(LOOKALIKES), st.integers(1, 2000))
NESTED = st.builds(
    lambda d, box: ("\\boxed{" if box else "") + "{" * d + "x" + "}" * d + ("}" if box else ""),
    st.integers(1, 1000),
    st.booleans(),
)
HUGE = st.sampled_from(["9" * 5000, "1e99999", "10^{400}", "-" + "9" * 4400, "0." + "0" * 4000 + "1", "1,000" * 900])
MODEL_TEXT = st.lists(st.one_of(PIECES, RUNS, NESTED, HUGE, st.sampled_from(LOOKALIKES), SURROGATES), max_size=10).map(
    "".join
)
TEXT = st.one_of(HOSTILE_TEXT, TURN_TEXT, MODEL_TEXT)
# Shorter text where math-verify reads it: its own parse of a long formula runs to the time limit (seconds).
SHORT_PIECES = st.one_of(
    st.sampled_from(LOOKALIKES), st.text(max_size=8), SURROGATES, st.sampled_from(["42", "\\frac{1}{2}", "9" * 5000])
)
SHORT_TEXT = st.lists(SHORT_PIECES, max_size=8).map("".join)
# An opener, a 20,000-character run of one or two look-alikes, then an ending that may close or break it.
LONG_TEXT = st.builds(
    lambda start, a, b, end: start + (a + b) * (LONG // len(a + b)) + end,
    st.sampled_from(["", "```", "####", "\\boxed{1 ", "1", "<answer>", "\\hspace{"]),
    st.sampled_from(LOOKALIKES),
    st.sampled_from(["", *LOOKALIKES]),
    st.sampled_from(["", "!", "}", "\n", "x", "</answer>", "```"]),
)
# Text a box's braces can wrap: no backslash, braces balanced.
BALANCED = st.recursive(
    st.text(st.characters(codec=None, exclude_categories=(), exclude_characters="\\{}"), max_size=10),
    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
    max_leaves=8,
)
NO_TAG = TEXT.map(lambda s: s.replace("<", "&lt;"))  # no '<': no tag can open in it


def elapsed(fn, *args) -> float:
    """The calling thread's CPU seconds for fn(*args), the least of 2 calls: work done, not time spent waiting."""
    best = math.inf
    for _ in range(2):
        t0 = time.thread_time()
        fn(*args)
        best = min(best, time.thread_time() - t0)
    return best


@contextmanager
def no_math_verify():
    """math_answer with math-verify's parse replaced by the identity: what is left is our own text work."""
    with mock.patch.object(math_task, "_mv_parse", lambda text: [text]):
        yield


# ------------------------------------------------------------------------ the old code, as oracles of meaning
def last_boxed_quadratic(text: str) -> str | None:
    """last_boxed as it was before the one-pass scan (a rescan per box): the meaning the new one must keep."""
    for m in reversed(list(math_task._BOX_OPEN.finditer(text))):
        depth, j = 1, m.end()
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[m.end() : j].strip()
            j += 1
    return None


_OLD_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_OLD_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OLD_HASH = re.compile(r"####[ \t]*\n?[ \t]*([-+.$€£¥₹\\(\d][^\n]*)")
_OLD_WORDS = re.compile(
    r"((?:[-+]\s*)?(?:\\?\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\\frac\{\d+\}\{\d+\}|\s*/\s*\d+)?)"
    r"\s+[A-Za-z]{2,}[A-Za-z'.-]*(?:\s+[A-Za-z][A-Za-z'.-]*)*"
)
_OLD_SPACING = r"~|\\[,;:>! ]|\\q?quad\b|\\thinspace\b|\\hspace\*?\{[^}]*\}|\{,?\}"
_OLD_SPLIT = re.compile(rf"\d(?:\s|{_OLD_SPACING})+\d")
_OLD_LATEX_SPLIT = re.compile(rf"\d\s*(?:(?:{_OLD_SPACING})\s*)+\d")
_OLD_FENCE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)^[ \t]*```", re.M | re.S | re.I)
# Short text over the alphabets the changed patterns read, for old == new on the inputs the old ones can afford.
REGEX_TEXT = st.lists(
    st.sampled_from(
        ["1", "23", " ", "\t", "\n", "####", "-", "$", "(", "\\", "a", "ab", "x'", ".", ",", "/", "\\frac{1}{2}", "!",
         "```", "python", "py", "3", "<answer>", "</answer>", "<search>", "</search>", "\\hspace{", "}", "{", "\\,"]
    ),
    max_size=20,
).map("".join)  # fmt: skip


# ---------------------------------------------------------------------------------------------- math: helpers
@given(TEXT)
def test_last_boxed_is_total_stripped_and_means_what_it_did(text):
    out = last_boxed(text)
    assert out is None or (isinstance(out, str) and out == out.strip())
    if len(text) < 3000:  # the old scan is quadratic: compare where it is quick
        assert out == last_boxed_quadratic(text)


@given(TEXT, BALANCED)
def test_a_closed_box_at_the_end_is_the_answer_whatever_precedes_it(text, inner):
    # The last box closes at its own brace whatever came before: open boxes, stray braces, a trailing backslash.
    assert last_boxed(f"{text}\\boxed{{{inner}}}") == inner.strip()


@given(TEXT, st.text(st.characters(codec=None, exclude_categories=(), exclude_characters="\\{}"), max_size=50))
def test_text_without_backslash_or_brace_around_a_completion_changes_no_box(text, plain):
    assert last_boxed(plain + text + plain) == last_boxed(text)


@given(TEXT)
def test_normalise_answer_and_has_answer_are_total(text):
    out = normalise_answer(text)
    assert out is None or (isinstance(out, str) and out == out.strip())
    assert isinstance(math_has_answer(text), bool)
    assert math_has_answer(text + "\\boxed{") and math_has_answer(text + "\n#### 4")


@given(LONG_TEXT)
def test_math_text_work_is_linear_on_long_runs(text):
    assert elapsed(last_boxed, text) < TIME_BOUND_S
    assert elapsed(normalise_answer, text) < TIME_BOUND_S
    assert elapsed(math_has_answer, text) < TIME_BOUND_S
    with no_math_verify():  # the box, '#### N' and whole-text paths, math-verify aside
        assert elapsed(math_answer, text) < TIME_BOUND_S
        assert elapsed(math_answer, f"\\boxed{{{text}}}") < TIME_BOUND_S
        assert elapsed(math_answer, text.replace("\\boxed", "")) < TIME_BOUND_S


@given(REGEX_TEXT)
def test_rewritten_math_patterns_match_what_they_did(text):
    assert math_task._HASH_ANSWER.findall(text) == _OLD_HASH.findall(text)
    old, new = _OLD_WORDS.fullmatch(text), math_task._NUMBER_THEN_WORDS.fullmatch(text)
    assert (old and old.groups()) == (new and new.groups())
    if not re.search(r"\\hspace\*?\{[^{}]*\{", text):  # an \hspace length holding a brace is no longer one
        assert bool(math_task._SPLIT_NUMBER.search(text)) == bool(_OLD_SPLIT.search(text))
        assert bool(math_task._LATEX_SPLIT.search(text)) == bool(_OLD_LATEX_SPLIT.search(text))


# --------------------------------------------------------------------------------------------- math: grading
def _math_example(reference: str) -> Example:
    return Example("q", reference, reference, "t:1")


EX = _math_example("r")


@given(
    st.lists(st.one_of(SHORT_TEXT, st.sampled_from(["\\boxed{42}", "#### 42", "The answer is 42."])), min_size=1,
             max_size=3),
    st.one_of(st.sampled_from(["42", "\\frac{1}{2}", "1234"]), SHORT_TEXT),
    st.sampled_from(["math", "gsm8k"]),
)  # fmt: skip
def test_math_grading_scores_every_completion_zero_or_one_and_never_raises(completions, reference, fmt):
    s = score_completions(MathTask(fmt), completions, [_math_example(reference)] * len(completions), 2.0)
    assert len(s.rewards) == len(s.correct) == len(s.formatted) == len(completions)
    assert all(r in (0.0, 1.0) for r in s.rewards)
    assert s.correct == [r == 1.0 for r in s.rewards]
    assert all(isinstance(f, bool) for f in s.formatted)
    assert s.errors + s.timeouts + s.invalid <= len(completions)


@given(st.lists(st.one_of(SHORT_TEXT, st.sampled_from(["\\boxed{42}", "#### 42", "\\boxed{2}"])), max_size=4))
def test_math_answer_classes_are_first_seen_ids_or_none(completions):
    classes = math_answer_classes(completions, timeout_s=2.0)
    assert len(classes) == len(completions)
    seen = [c for c in classes if c is not None]
    assert all(c <= max(seen[:i], default=-1) + 1 for i, c in enumerate(seen))  # a new class is the next id


@given(SHORT_TEXT)
def test_math_answer_is_a_list(text):
    assert isinstance(guarded(lambda: math_answer(text), 2.0, []), list)
    with no_math_verify():
        assert isinstance(math_answer(text), list)


# --------------------------------------------------------------------------------------------------- code
@given(TEXT, st.text(max_size=20), st.sampled_from(["", "f", "solve"]), st.booleans())
def test_code_extraction_is_total(text, prompt, entry_point, mid_line):
    block = last_fenced_block(text)
    assert block is None or isinstance(block, str)
    cont = function_continuation(text, mid_line)
    assert text.startswith(cont) and function_continuation(cont, mid_line) == cont  # a prefix, and a fixed point
    assert isinstance(program_for(text, prompt, entry_point), str)
    assert isinstance(has_code(text), bool)


@given(TEXT.map(lambda s: s.replace("`", "'")), st.text(max_size=50).map(lambda s: s.replace("`", "'")))
def test_a_closed_fence_at_the_end_is_the_program(text, body):
    assert last_fenced_block(f"{text}\n```python\n{body}\n```\n") == body + "\n"


@given(LONG_TEXT)
def test_code_extraction_is_linear_on_long_runs(text):
    assert elapsed(last_fenced_block, text) < TIME_BOUND_S
    assert elapsed(program_for, text, "def f():\n", "f") < TIME_BOUND_S
    assert elapsed(function_continuation, text) < TIME_BOUND_S


@given(REGEX_TEXT)
def test_rewritten_fence_pattern_matches_what_it_did(text):
    from rl_training.tasks.code.extract import _FENCE

    assert _FENCE.findall(text) == _OLD_FENCE.findall(text)


# ------------------------------------------------------------------------------------------------- search
@given(TEXT)
def test_search_parsing_is_total_and_means_what_it_did(text):
    kind, arg = parse_action(text)
    assert kind in ("search", "answer", "invalid") and isinstance(arg, str) and arg == arg.strip()
    assert kind != "invalid" or arg == ""
    answer = last_answer(text)
    assert answer is None or (isinstance(answer, str) and answer == answer.strip())
    if len(text) < 3000:  # the old patterns are quadratic on unclosed tags: compare where they are quick
        m = _OLD_ACTION.search(text)
        assert (kind, arg) == ((m.group(1), m.group(2).strip()) if m else ("invalid", ""))
        found = _OLD_ANSWER.findall(text)
        assert answer == (found[-1].strip() if found else None)


@given(NO_TAG, st.sampled_from(["search", "answer"]), TEXT, TEXT)
def test_the_first_complete_pair_decides_whatever_follows(prefix, kind, inner, rest):
    inner = inner.replace(f"</{kind}>", "")
    assume(f"</{kind}>" not in inner)  # removing one can join another
    assert parse_action(f"{prefix}<{kind}>{inner}</{kind}>{rest}") == (kind, inner.strip())


@given(TEXT, TEXT)
def test_a_closed_answer_at_the_end_is_the_last_answer(text, inner):
    inner = inner.replace("</answer>", "")
    assume("</answer>" not in inner)
    # The leading </answer> closes an answer the text left open, as a turn's stop string would.
    assert last_answer(f"{text}</answer><answer>{inner}</answer>") == inner.strip()


@given(TEXT, st.lists(TEXT, min_size=1, max_size=3), st.sampled_from(["em", "subem"]), st.floats(0, 1))
def test_search_reward_is_total(text, golden, match, format_score):
    r = search_reward(text, golden, match, format_score)
    assert r in (0.0, 1.0, format_score)
    norm = normalize_answer(text)
    assert isinstance(norm, str) and normalize_answer(norm) == norm
    assert exact_match(text, [text]) and substring_match(text, [text])
    classes = search_answer_classes([text, *golden])
    assert len(classes) == len(golden) + 1


@given(LONG_TEXT)
def test_search_parsing_is_linear_on_long_runs(text):
    assert elapsed(parse_action, text) < TIME_BOUND_S
    assert elapsed(last_answer, text) < TIME_BOUND_S
    assert elapsed(search_reward, text, ["x"]) < TIME_BOUND_S
    assert elapsed(normalize_answer, text) < TIME_BOUND_S


# ------------------------------------------------------------------------------------------------ reverse
@given(TEXT, st.text(max_size=20))
def test_reverse_reward_is_a_fraction(text, reference):
    r = reverse_reward(text, reference)
    assert 0.0 <= r <= 1.0 and (r == 1.0) == (text.strip() == reference)
    assert isinstance(reverse_has_answer(text), bool)
    s = score_completions(ReverseTask(), [text], [Example("q", reference, reference, "t:1")], 1.0)
    assert s.rewards == [r]


# -------------------------------------------------------------------------------------- base: odd graders
class RaisingFloat:
    """A reward value whose float() raises `exc` (a user's tensor-like type, a lazy value that fails late)."""

    def __init__(self, exc: type[BaseException]):
        self.exc = exc

    def __float__(self) -> float:
        raise self.exc("no float")


class RaisingBool:
    def __bool__(self) -> bool:
        raise RuntimeError("no truth value")


EXCEPTIONS = st.sampled_from([OverflowError, RuntimeError, ZeroDivisionError, RecursionError, KeyError, TypeError])
ODD_VALUES = st.one_of(
    RETURN_VALUES,
    st.floats(),
    st.integers(),
    st.sampled_from([10**400, -(10**400), Fraction(10**400, 3), np.float64("nan"), np.float32(1.5), np.int64(3)]),
    st.sampled_from([np.array([1.0]), np.array([1.0, 2.0]), np.float16("inf"), 1j, "1.0", b"1", None, True]),
    st.fractions(),
    st.decimals(),
    EXCEPTIONS.map(RaisingFloat),
    st.just(RaisingBool()),
)


class OddTask(Task):
    """A user's per-completion grader: the completion picks the value `reward` and `has_answer` return."""

    def __init__(self, values: list):
        self.values = values

    def reward(self, completion, example):
        value = self.values[int(completion)]
        if isinstance(value, type) and issubclass(value, Exception):
            raise value("grader failed")
        return value

    def has_answer(self, completion):
        return self.values[int(completion)]


class OddBatchTask(Task):
    """A user's batch grader whose Scores carry odd values, the wrong lengths, or are not Scores at all."""

    part_names = ("p",)
    count_names = ("c",)

    def __init__(self, out):
        self.out = out

    def grade(self, completions, examples, timeout_s):
        return self.out


@given(ODD_VALUES)
def test_finite_reward_is_a_finite_float_or_none(value):
    out = finite_reward(value)
    assert out is None or (type(out) is float and math.isfinite(out))


@given(st.lists(st.one_of(ODD_VALUES, EXCEPTIONS), min_size=1, max_size=6))
def test_a_user_reward_returning_anything_is_scored_and_counted(values):
    n = len(values)
    s = score_completions(OddTask(values), [str(i) for i in range(n)], [EX] * n, 1.0)
    assert len(s.rewards) == len(s.formatted) == len(s.correct) == n
    assert all(type(r) is float and math.isfinite(r) for r in s.rewards)
    assert all(isinstance(f, bool) for f in s.formatted)
    raised = sum(isinstance(v, type) for v in values)
    assert s.errors == raised and s.errors + s.invalid <= n


@given(
    st.lists(ODD_VALUES, max_size=4),
    st.lists(st.one_of(st.booleans(), st.just(RaisingBool()), ODD_VALUES), max_size=4),
    st.dictionaries(st.sampled_from(["p", "q"]), st.lists(ODD_VALUES, max_size=4), max_size=2),
    st.dictionaries(st.sampled_from(["c", "d"]), ODD_VALUES, max_size=2),
    st.one_of(st.integers(0, 3), ODD_VALUES),
)
def test_a_batch_grader_returning_anything_is_scored_and_counted(rewards, formatted, parts, counts, errors):
    n = 3
    for out in (Scores(rewards, [False] * len(rewards), formatted, errors, 0, 0, parts, counts), None, [1.0] * n):
        s = score_completions(OddBatchTask(out), ["a"] * n, [EX] * n, 1.0)
        assert len(s.rewards) == len(s.formatted) == len(s.correct) == len(s.parts["p"]) == n
        assert all(type(r) is float and math.isfinite(r) for r in s.rewards)
        assert set(s.parts) == {"p"} and set(s.counts) == {"c"}


@given(st.one_of(EXCEPTIONS, st.just(RewardTimeout)), ODD_VALUES)
def test_guarded_returns_the_default_for_any_failure(exc, default):
    def fail():
        raise exc("grader failed")

    assert guarded(fail, 1.0, default) is default
    assert guarded(lambda: default, 1.0, None) is default


# ------------------------------------------------------------------------- regressions: one per class fixed
def test_many_unclosed_boxes_are_one_pass():
    # '\boxed{' x 2857 (20,000 characters): each box rescanned to the end, 4.4-7.3 s; one pass now, 2 ms.
    text = "\\boxed{" * (LONG // 7)
    assert elapsed(last_boxed, text) < TIME_BOUND_S and last_boxed(text) is None
    assert last_boxed(text + "\\boxed{4}") == "4" and last_boxed("\\boxed{4}" + text) == "4"


def test_a_long_blank_run_after_hash_marks_is_linear():
    # '####' + 20,000 blanks: two adjacent [ \t]* runs split the blanks every way, 3-5.7 s; one way now, 2 ms.
    with no_math_verify():
        assert elapsed(math_answer, "#### " + " \t" * (LONG // 2) + "!") < TIME_BOUND_S
        assert math_answer("#### \n 42 apples") == ["42 apples"]


def test_a_long_word_after_a_boxed_number_is_linear():
    # '\boxed{1 aaaa...!}' (20,000 letters): [A-Za-z]{2,}[A-Za-z'.-]* split the word every way, 7.5-14 s; 8 ms now.
    with no_math_verify():
        assert elapsed(math_answer, "\\boxed{1 " + "a" * LONG + "!}") < TIME_BOUND_S
        assert math_answer("\\boxed{12 dollars}") == ["\\boxed{12}"]


def test_a_long_blank_run_after_a_fence_is_linear():
    # '```' + 40,000 tabs: blanks around the optional language name, 2.3-4.1 s; 6 ms now.
    text = "```" + "\t" * 40_000 + "!"
    assert elapsed(last_fenced_block, text) < TIME_BOUND_S and last_fenced_block(text) is None
    assert last_fenced_block("``` \t python \t\nx = 1\n```") == "x = 1\n"


def test_many_unclosed_hspace_groups_are_linear():
    # '1\hspace{' x 22,222 (200,000 characters, no '}'): each digit's spacing scanned to the end, 3.8-5.5 s; 60 ms.
    text = "1\\hspace{" * 22_222
    assert elapsed(normalise_answer, text) < TIME_BOUND_S
    with no_math_verify():
        assert elapsed(math_answer, text) < TIME_BOUND_S
    assert normalise_answer("1\\hspace{1em}2") is None  # still digits split apart


def test_many_unclosed_tags_are_one_pass():
    # '<answer>' / '<search>' x 6,000 (48,000 characters): each opening rescanned to the end, 1.2-2.7 s; 5 ms now.
    for tag in ("<answer>", "<search>"):
        text = tag * 6000
        assert elapsed(parse_action, text) < TIME_BOUND_S and parse_action(text) == ("invalid", "")
        assert elapsed(last_answer, text) < TIME_BOUND_S and last_answer(text) is None
    assert parse_action("<search>a <answer>b</answer>") == ("answer", "b")  # the first complete pair
    assert last_answer("<answer>a<answer>b</answer></answer>") == "a<answer>b"


def test_a_reward_past_float_range_is_invalid_not_a_batch_error():
    # float(10**400) raises OverflowError, which finite_reward did not catch: the whole batch scored 0 as errors.
    assert finite_reward(10**400) is None and finite_reward(RaisingFloat(RuntimeError)) is None
    s = score_completions(OddTask([1.0, 10**400, RaisingFloat(RuntimeError)]), ["0", "1", "2"], [EX] * 3, 1.0)
    assert s.rewards == [1.0, 0.0, 0.0] and (s.errors, s.invalid) == (0, 2)


def test_a_numeric_string_is_not_a_reward():
    assert finite_reward("1.0") is None and finite_reward(b"1") is None and finite_reward(np.float32(0.5)) == 0.5


def test_a_format_check_whose_truth_raises_is_unformatted_not_a_batch_error():
    # bool() of has_answer's value ran outside `guarded`: Task.grade raised and the batch scored 0 as errors.
    task = OddTask([True, RaisingBool()])
    s = task.grade(["0", "1"], [EX] * 2, 1.0)
    assert s.formatted == [True, False] and (s.errors, s.invalid) == (0, 1)  # RaisingBool is no number either
    assert score_completions(task, ["0", "1"], [EX] * 2, 1.0).rewards == [1.0, 0.0]


class SwallowsTheAlarm(Task):
    """A grader that catches every Exception around slow work, as math-verify's parse and verify do."""

    def reward(self, completion, example):
        try:
            time.sleep(5)
        except Exception:  # noqa: BLE001 -- the pattern under test
            pass
        return 1.0

    def has_answer(self, completion):
        return self.reward(completion, None) == 1.0


def test_a_grader_that_swallows_the_alarm_still_times_out():
    # The alarm's RewardTimeout is an Exception: math-verify's parse('\boxed{9^{9^{9^{9^{9}}}}}') under a 0.3 s limit
    # caught it and returned its raw-string fallback, so the reward was graded with timeouts == 0.
    s = score_completions(SwallowsTheAlarm(), ["a"], [EX], 0.2)
    assert s.rewards == [0.0] and s.timeouts == 1 and s.formatted == [False]
    assert guarded(lambda: SwallowsTheAlarm().reward("a", EX), 0.2, "late") == "late"


class SwallowsEveryStage(Task):
    """Five stages of 1 s, each catching every Exception (math-verify's parse tries several extractions so)."""

    def reward(self, completion, example):
        for _ in range(5):
            try:
                time.sleep(1)
            except Exception:  # noqa: BLE001 -- the pattern under test
                pass
        return 1.0


def test_a_grader_that_swallows_each_alarm_is_cut_short_at_every_stage():
    """A one-shot alarm stopped only the first stage: 0.2 s + 4 x 1 s = 4.2 s of work past a 0.2 s limit. The
    alarm repeats every 0.05 s past the limit, so each later stage ends within 0.05 s: about 0.4 s in all. The
    bound lies halfway between that and the 4.2 s: 2.3 s."""
    t0 = time.perf_counter()
    s = score_completions(SwallowsEveryStage(), ["a"], [EX], 0.2)
    assert time.perf_counter() - t0 < 2.3 and s.timeouts == 1 and s.rewards == [0.0]


def test_odd_values_in_a_batch_graders_parts_score_the_batch_zero_not_raise():
    # float() of parts and bool() of formatted ran outside score_completions' try: an OverflowError escaped.
    for out in (
        Scores([1.0] * 2, [True] * 2, [True] * 2, parts={"p": [10**400, 0.0]}),
        Scores([1.0] * 2, [True] * 2, [RaisingBool(), True]),
        Scores([1.0] * 2, [True] * 2, [True]),  # one format flag for two completions
    ):
        s = score_completions(OddBatchTask(out), ["a", "b"], [EX] * 2, 1.0)
        assert s.rewards == [0.0, 0.0] and s.errors == 2 and s.parts == {"p": [0.0, 0.0]}


def test_unprintable_and_surrogate_values_do_not_reach_an_exception():
    assert finite_reward(Unprintable()) is None
    assert last_boxed("\\boxed{\ud800}") == "\ud800" and parse_action("<answer>\udfff</answer>") == ("answer", "\udfff")
