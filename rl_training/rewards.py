"""Verifiable rewards: pure functions (completion, reference) -> float, and a safe batch scorer.

One grader serves training and evaluation (evals/ imports this module), so a completion scores the same
in both. A reward function that raises or runs past its time limit scores 0 for that completion; the
scorer counts it and the run goes on.

Graders
- `math_reward`: math-verify (HF) equivalence of the completion's final answer with the reference. It
  handles LaTeX (\\frac, \\boxed), '#### N', thousands separators and units better than a regex would.
  The reference is a bare final answer (data/sources.py normalises it), so it is parsed as the content of
  a \\boxed{}: bare LaTeX such as '3\\sqrt{13}' or '6 - 5i' otherwise parses as its first number. The
  completion's answer is the content of its last complete \\boxed{} alone (braces matched), so an earlier
  boxed guess is not graded with it as a set. Boxed content that is a number followed by plain words
  ('18 dollars', '1,234 pages') is graded as the number: math-verify knows unit words such as 'cm' or
  'hours' but reads 'dollars' as a product of symbols. The first word needs 2+ letters, so '5 x' stays
  algebra; LaTeX content ('18\\text{ dollars}') is left to math-verify. A completion without a complete
  \\boxed{} that commits to '#### N' is graded on the text after its last '#### N' up to the end of that
  line, so numbers in text generated after the answer do not replace it.
- `reverse_reward`: the synthetic string-reversal task; dense partial credit = matching positions /
  max(len(pred), len(ref)), so 1.0 only for the exact reversal.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from rl_training.code import CODE_FORMATS
from rl_training.data.sources import Example, last_boxed

RewardFn = Callable[[str, str], float]


# ------------------------------------------------------------------------------------------------- graders
def _mv_parse(text: str):
    from math_verify import parse

    # Our own time limit wraps the call (see `_time_limit`); math-verify's alarm-based one would replace it.
    return parse(text, parsing_timeout=None)


# '#### N' as GSM8K writes it: the line must start like an answer (digit, sign, '.', '$', '\\', '('), so a
# markdown heading such as '#### Step 2: ...' is not taken for one.
_HASH_ANSWER = re.compile(r"####[ \t]*\n?[ \t]*([-+.$\\(\d][^\n]*)")


def math_gold(reference: str) -> list:
    """The parsed reference: read as the content of a \\boxed{} (see the module docstring)."""
    if "\\boxed" not in reference:
        gold = _mv_parse(f"\\boxed{{{reference}}}")
        if gold:
            return gold
    return _mv_parse(reference if "$" in reference or "\\" in reference else f"${reference}$")


# A number (sign, '$', thousands commas, decimals, a simple fraction) then plain words: the words are a unit.
_NUMBER_THEN_WORDS = re.compile(
    r"((?:[-+]\s*)?(?:\\?\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?)"
    r"\s+[A-Za-z]{2,}[A-Za-z'.-]*(?:\s+[A-Za-z][A-Za-z'.-]*)*"
)


def math_answer(completion: str) -> list:
    """The parsed final answer of a completion: its last complete \\boxed{} (a number before plain words
    read as the number), else the line after the last '#### N', else whatever math-verify extracts from
    the whole text (empty when nothing)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        unit = _NUMBER_THEN_WORDS.fullmatch(boxed)
        return _mv_parse(f"\\boxed{{{unit.group(1) if unit else boxed}}}")
    marked = _HASH_ANSWER.findall(completion)
    answer = _mv_parse(marked[-1]) if marked else []
    return answer or _mv_parse(completion)


def math_reward(completion: str, reference: str) -> float:
    from math_verify import verify

    gold = math_gold(reference)
    pred = math_answer(completion)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


_BOXED_OR_HASH = re.compile(r"\\boxed\s*\{|####\s*\S")


def math_has_answer(completion: str) -> bool:
    """Format check: the completion commits to a final answer (\\boxed{...} or '#### N')."""
    return bool(_BOXED_OR_HASH.search(completion))


def reverse_reward(completion: str, reference: str) -> float:
    pred = completion.strip()
    if not pred and not reference:
        return 1.0
    same = sum(a == b for a, b in zip(pred, reference, strict=False))
    return same / max(len(pred), len(reference))


def reverse_has_answer(completion: str) -> bool:
    pred = completion.strip()
    return bool(pred) and pred.isalpha()


# ------------------------------------------------------------------------------------ answers for voting
AnswerClassesFn = Callable[[Sequence[str], float], list]


def exact_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by the stripped completion (the reversal task's answer); empty = no answer (None)."""
    ids: dict[str, int] = {}
    out: list[int | None] = []
    for c in completions:
        key = c.strip()
        out.append(ids.setdefault(key, len(ids)) if key else None)
    return out


def math_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by math-verify equivalence of the final answers `math_reward` grades: each answer
    joins the first earlier class whose representative it verifies equal to. No answer, or a parse that
    fails or times out, is None (it does not vote)."""
    from math_verify import verify

    reps: list = []
    out: list[int | None] = []
    for c in completions:
        pred = _guarded(lambda c=c: math_answer(c), timeout_s, default=[])
        if not pred:
            out.append(None)
            continue
        for i, rep in enumerate(reps):
            if _guarded(lambda rep=rep, pred=pred: verify(rep, pred, timeout_seconds=None), timeout_s, False):
                out.append(i)
                break
        else:
            reps.append(pred)
            out.append(len(reps) - 1)
    return out


@dataclass
class Scores:
    """A batch's grades, in completion order. `parts` and `counts` carry what a task knows beyond one reward
    (the metrics logger writes them as reward/<name>_mean and reward/<name>; samples keep the parts)."""

    rewards: list[float]
    correct: list[bool]
    formatted: list[bool]
    errors: int  # reward function raised (scored 0)
    timeouts: int  # reward function exceeded its limit (scored 0)
    invalid: int  # returned a non-finite or non-numeric value (scored 0)
    parts: dict[str, list[float]] = field(default_factory=dict)  # [name][N] reward components per completion
    counts: dict[str, float] = field(default_factory=dict)  # per-batch counters (e.g. failure classes)


# Scores a whole batch at once, for graders that are cheaper or only safe that way (a sandbox pool running
# programs in parallel, a grader with per-batch state): (completions, examples, timeout_s) -> Scores.
BatchScorer = Callable[[Sequence[str], Sequence[Example], float], Scores]


@dataclass(frozen=True)
class Task:
    """What a data format means for scoring: the reward, the format check, 'correct', and which sampled
    answers count as the same vote (maj@k). A task with a `batch_scorer` is graded by it, one call per batch;
    `reward` then still grades a single completion (evals' per-sample tools)."""

    reward: RewardFn
    has_answer: Callable[[str], bool]
    correct_threshold: float = 1.0  # reward >= this counts as correct (accuracy)
    answer_classes: AnswerClassesFn = exact_answer_classes
    batch_scorer: BatchScorer | None = None
    # The names of the batch scorer's `parts` and `counts`: fixed per task, so every rank logs (and reduces)
    # the same keys whatever one rank's batch did; a name the scorer leaves out reads 0.
    part_names: tuple[str, ...] = ()
    count_names: tuple[str, ...] = ()


def _code_task() -> Task:
    """humaneval / mbpp / stdio (rl_training/code): programs judged in the sandbox pool, a batch per call."""
    from rl_training.code import COUNT_NAMES, PART_NAMES
    from rl_training.code.extract import has_code

    def batch_scorer(completions, examples, timeout_s):
        from rl_training.code.tasks import score_code_batch  # the sandbox side imports this module

        return score_code_batch(completions, examples, timeout_s)

    def reward(completion: str, reference: str) -> float:
        raise TypeError("code tasks are graded in batches (Task.batch_scorer): tests live in Example.meta")

    return Task(reward, has_code, batch_scorer=batch_scorer, part_names=PART_NAMES, count_names=COUNT_NAMES)


TASKS: dict[str, Task] = {
    "gsm8k": Task(math_reward, math_has_answer, answer_classes=math_answer_classes),
    "math": Task(math_reward, math_has_answer, answer_classes=math_answer_classes),
    "reverse": Task(reverse_reward, reverse_has_answer),
    **dict.fromkeys(CODE_FORMATS, _code_task()),
}


# ------------------------------------------------------------------------------------------ safe scoring
class RewardTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM-based limit (Unix, main thread). Elsewhere the limit cannot be enforced and is skipped."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum, frame):
        raise RewardTimeout

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_NO_RESULT = object()


def _guarded(fn: Callable, timeout_s: float, default):
    """fn() under the time limit; `default` if it times out or raises (math-verify on odd input)."""
    try:
        with _time_limit(timeout_s):
            return fn()
    except RewardTimeout:
        return default
    except Exception:  # noqa: BLE001 -- same policy as score_completions: a grader failure scores, never stops
        return default


def score_completions(task: Task, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
    """Grade completions[i] against examples[i]. Never raises for what a grader does: a raise, a time-out or a
    non-finite value scores 0 and is counted."""
    if len(completions) != len(examples):
        raise ValueError(f"score_completions: {len(completions)} completions for {len(examples)} examples")
    if task.batch_scorer is not None:
        return _score_batch(task, completions, examples, timeout_s)
    rewards, correct, formatted = [], [], []
    errors = timeouts = invalid = 0
    for c, ref in zip(completions, (ex.reference for ex in examples), strict=True):
        r, out = 0.0, _NO_RESULT
        try:
            with _time_limit(timeout_s):
                out = task.reward(c, ref)
        except RewardTimeout:
            timeouts += 1
        except Exception:  # noqa: BLE001 -- a user reward may raise anything; it must never stop the run
            errors += 1
        if out is not _NO_RESULT:
            try:
                r = float(out)
            except (TypeError, ValueError):
                r = float("nan")
            if not math.isfinite(r):
                invalid, r = invalid + 1, 0.0
        rewards.append(r)
        correct.append(r >= task.correct_threshold)
        formatted.append(bool(_guarded(lambda c=c: task.has_answer(c), timeout_s, False)))  # raising = unformatted
    return Scores(rewards, correct, formatted, errors, timeouts, invalid)


def _score_batch(task: Task, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
    """A batch scorer's Scores, checked: a raise scores the whole batch 0 (counted as errors); rewards that are
    not finite numbers score 0 (counted as invalid). Its own time limits are its business (a sandbox enforces
    per-program deadlines), so no alarm wraps the call."""
    n = len(completions)
    try:
        s = task.batch_scorer(completions, examples, timeout_s)
        if len(s.rewards) != n:
            raise ValueError(f"batch scorer returned {len(s.rewards)} rewards for {n} completions")
    except Exception:  # noqa: BLE001 -- like a per-completion reward: a grader failure scores 0, never stops
        return Scores(
            [0.0] * n,
            [False] * n,
            [False] * n,
            errors=n,
            timeouts=0,
            invalid=0,
            parts={k: [0.0] * n for k in task.part_names},
            counts=dict.fromkeys(task.count_names, 0.0),
        )
    rewards, invalid = [], s.invalid
    for out in s.rewards:
        try:
            r = float(out)
        except (TypeError, ValueError):
            r = float("nan")
        if not math.isfinite(r):
            invalid, r = invalid + 1, 0.0
        rewards.append(r)
    correct = [r >= task.correct_threshold for r in rewards]
    parts = {k: [float(x) for x in s.parts.get(k, [0.0] * n)] for k in task.part_names}
    counts = {k: float(s.counts.get(k, 0.0)) for k in task.count_names}
    return Scores(rewards, correct, list(s.formatted), s.errors, s.timeouts, invalid, parts, counts)
