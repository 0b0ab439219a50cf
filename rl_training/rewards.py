"""Verifiable rewards: pure functions (completion, reference) -> float, and a safe batch scorer.

One grader serves training and evaluation (evals/ imports this module), so a completion scores the same
in both. A reward function that raises or runs past its time limit scores 0 for that completion; the
scorer counts it and the run goes on.

Graders
- `math_reward`: math-verify (HF) equivalence of the completion's final answer (its last complete \\boxed{},
  else its '#### N' line, else the whole text) with the reference, parsed as one whole answer; number
  formatting normalised on both sides first. The rules, stated once: docs/evaluation.md, "Grading rules";
  the cases: tests/test_grading.py.
- `reverse_reward`: the synthetic string-reversal task; dense partial credit = matching positions /
  max(len(pred), len(ref)), so 1.0 only for the exact reversal.
- search tasks: Search-R1's exact (or substring) match of the last <answer> of the sampled text against any
  golden answer in Example.meta (rl_training/search/reward.py), graded by `search_batch_scorer`.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from rl_training.code import CODE_FORMATS
from rl_training.data.sources import Example, last_boxed
from rl_training.search.reward import exact_match, last_answer, normalize_answer, search_reward, substring_match

RewardFn = Callable[[str, str], float]


# ------------------------------------------------------------------------------------------------- graders
def _mv_parse(text: str):
    from math_verify import parse

    # Our own time limit wraps the call (see `_time_limit`); math-verify's alarm-based one would replace it.
    return parse(text, parsing_timeout=None)


# '#### N' as GSM8K writes it: the line must start like an answer (digit, sign, '.', '$', '\\', '('), so a
# markdown heading such as '#### Step 2: ...' is not taken for one.
_HASH_ANSWER = re.compile(r"####[ \t]*\n?[ \t]*([-+.$€£¥₹\\(\d][^\n]*)")


# ------------------------------------------------------------------------------- number formatting
# math-verify reads juxtaposed numbers as a sum ('1\\,234' -> 1 + 234 = 235, '7 2' -> 9), a trailing point
# ('1234.') as text, '€18' as text and '12.5\\%' as 0.125 while '50\\%' equals 50 (math_verify/grader.py:
# integer percents compare without the sign, float ones by value). So answers and references are rewritten
# into the plain forms it reads right before it sees them. The rules are listed in docs/evaluation.md.

# Unicode minus and dash look-alikes read as '-'; Unicode spaces (no-break, thin, narrow no-break: common
# thousands separators) as a plain space.
_CHAR_MAP = {
    **dict.fromkeys(map(ord, "\u2212\u2010\u2011\u2012\u2013\u2014\u2015\ufe63\uff0d"), "-"),
    **dict.fromkeys(map(ord, "\u00a0\u2007\u2008\u2009\u200a\u202f"), " "),
}
# Currency signs (a number's unit): dropped, as math-verify already drops '\\$' and words like 'dollars'.
_CURRENCY = re.compile(r"\\\$|\$|€|£|¥|₹|\\(?:euro|pounds|yen|textdollar|texteuro|textsterling|textyen)\b\s*")
# The percent rule: a percent sign is a unit like 'percent' and is dropped, so the number is compared as
# written: '12.5\\%' = '12.5' = '12.5%', never 0.125 (the Hendrycks MATH normaliser's rule too).
_PERCENT = re.compile(r"\\text\{\s*\\?%\s*\}|\\?%")
# One thousands separator between digit groups: LaTeX spaces ('\\,', '\\ ', '\\;', '\\:', '\\>', '\\!', '~',
# '\\thinspace'), '{,}', ',\\!' (MATH's), or plain spaces.
_LATEX_SEP = r"\\[,;:>! ]\s*|\\thinspace\b\s*|\{,\}|,\\!|~"


def _grouped(sep: str) -> re.Pattern:
    """1-3 digits, then groups of exactly three with the same separator each time; not within a longer number."""
    return re.compile(rf"(?<![\d.])(\d{{1,3}})({sep})(\d{{3}}(?:\2\d{{3}})*)(?!\d)")


_GROUPED = _grouped(rf"(?:{_LATEX_SEP}|[ \t]+)")
_GROUPED_LATEX = _grouped(rf"(?:{_LATEX_SEP})")
# A mixed number '1 1/2' is one number; math-verify reads '1 1/2' as 1 but '1\\frac{1}{2}' as 3/2.
_MIXED = re.compile(r"(?<![\d.])(\d+)[ \t]+(\d+)[ \t]*/[ \t]*(\d+)(?![\d.])")
# Any spacing between two digits, once the separators and mixed numbers above are read.
_LATEX_SPACING = r"~|\\[,;:>! ]|\\q?quad\b|\\thinspace\b|\\hspace\*?\{[^}]*\}|\{,?\}"
_SPLIT_NUMBER = re.compile(rf"\d(?:\s|{_LATEX_SPACING})+\d")
_LATEX_SPLIT = re.compile(rf"\d\s*(?:(?:{_LATEX_SPACING})\s*)+\d")
_TRAILING_POINT = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\.(?![\d.])")


def _join_groups(grouped: re.Pattern, text: str) -> str:
    return grouped.sub(lambda m: m.group(1) + m.group(3).replace(m.group(2), ""), text)


def _parse_whole(completion: str) -> list:
    """What math-verify extracts from a whole completion (no box, no '#### N' answer), with LaTeX thousands
    separators joined; nothing when LaTeX spacing splits other digits ('$7\\,2$', read as 9 otherwise). Plain
    spaces are left to math-verify: in running text it reads neither '7 2' nor '1 234' as a sum."""
    text = _join_groups(_GROUPED_LATEX, completion)
    return [] if _LATEX_SPLIT.search(text) else _mv_parse(text)


def normalise_answer(text: str) -> str | None:
    """A final answer (box content, '#### N' line or reference) with its number formatting made plain:
    dashes, currency and percent signs, thousands separators, a trailing decimal point. None when numbers are
    separated by spaces that are not thousands groups ('7 2'): no reading of it is the answer."""
    text = _PERCENT.sub("", _CURRENCY.sub("", text.translate(_CHAR_MAP)))
    text = _join_groups(_GROUPED, text)
    text = _MIXED.sub(r"\1\\frac{\2}{\3}", text)
    if _SPLIT_NUMBER.search(text):
        return None
    return _TRAILING_POINT.sub(r"\1", text).strip()


def math_gold(reference: str) -> list:
    """The parsed reference, formatting normalised, read as the content of a \\boxed{}: bare LaTeX such as
    '3\\sqrt{13}' or '6 - 5i' otherwise parses as its first number."""
    # A reference is data, not a policy's output: digits it writes apart are kept as written, not refused.
    reference = normalise_answer(reference) or reference.translate(_CHAR_MAP)
    if "\\boxed" not in reference:
        gold = _mv_parse(f"\\boxed{{{reference}}}")
        if gold:
            return gold
    return _mv_parse(reference if "$" in reference or "\\" in reference else f"${reference}$")


# A number (sign, '$', thousands commas, decimals, a simple fraction) then plain words: the words are a unit.
# math-verify knows unit words such as 'cm' or 'hours' but reads 'dollars' as a product of symbols; the first
# word needs 2+ letters, so '5 x' stays algebra.
_NUMBER_THEN_WORDS = re.compile(
    r"((?:[-+]\s*)?(?:\\?\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\\frac\{\d+\}\{\d+\}|\s*/\s*\d+)?)"
    r"\s+[A-Za-z]{2,}[A-Za-z'.-]*(?:\s+[A-Za-z][A-Za-z'.-]*)*"
)


def math_answer(completion: str) -> list:
    """The parsed final answer of a completion: its last complete \\boxed{} (a number before plain words
    read as the number), else the line after the last '#### N', else whatever math-verify extracts from
    the whole text (empty when nothing)."""
    completion = completion.translate(_CHAR_MAP)
    boxed = last_boxed(completion)
    if boxed is not None:
        boxed = normalise_answer(boxed)
        if not boxed:
            return []
        unit = _NUMBER_THEN_WORDS.fullmatch(boxed)
        return _mv_parse(f"\\boxed{{{unit.group(1) if unit else boxed}}}")
    marked = _HASH_ANSWER.findall(completion)
    if not marked:
        return _parse_whole(completion)
    line = normalise_answer(marked[-1])
    if line is None:  # '#### 7 2': no fallback to numbers elsewhere in the text either
        return []
    return (_mv_parse(line) if line else []) or _parse_whole(completion)


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


# ------------------------------------------------------------------------------------------ search tasks
SEARCH_PARTS = ("em", "subem", "answered")  # per episode: exact match, substring match, has an <answer>


def search_batch_scorer(match: str = "em", format_score: float = 0.0) -> BatchScorer:
    """Grades each completion (the episode's sampled text only, see search/reward.py) against all of its
    example's meta["golden_answers"] (the reference alone when there are none)."""

    def score(completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
        parts: dict[str, list[float]] = {k: [] for k in SEARCH_PARTS}
        rewards = []
        for c, ex in zip(completions, examples, strict=True):
            golden = ex.meta.get("golden_answers") or [ex.reference]
            rewards.append(search_reward(c, golden, match, format_score))
            pred = last_answer(c)
            parts["answered"].append(float(pred is not None))
            parts["em"].append(float(pred is not None and exact_match(pred, golden)))
            parts["subem"].append(float(pred is not None and substring_match(pred, golden)))
        correct = [x == 1.0 for x in parts[match]]
        return Scores(rewards, correct, [x == 1.0 for x in parts["answered"]], 0, 0, 0, parts)

    return score


def search_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by the normalised last answer; no answer = None."""
    ids: dict[str, int] = {}
    answers = [last_answer(c) for c in completions]
    return [None if a is None else ids.setdefault(normalize_answer(a), len(ids)) for a in answers]


def _search_reference_reward(completion: str, reference: str, match: str, format_score: float) -> float:
    return search_reward(completion, [reference], match, format_score)


def search_task(match: str = "em", format_score: float = 0.0) -> Task:
    """`reward` (one completion against the reference alone) serves evals' per-sample tools; training and
    evals' batch grading use every golden answer through the batch scorer."""
    return Task(
        partial(_search_reference_reward, match=match, format_score=format_score),
        lambda c: last_answer(c) is not None,
        answer_classes=search_answer_classes,
        batch_scorer=search_batch_scorer(match, format_score),
        part_names=SEARCH_PARTS,
    )


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
    "search": search_task("em"),
    "search_subem": search_task("subem"),
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
            checked = _finite_reward(out)
            invalid += checked is None
            r = checked or 0.0
        rewards.append(r)
        correct.append(r >= task.correct_threshold)
        formatted.append(bool(_guarded(lambda c=c: task.has_answer(c), timeout_s, False)))  # raising = unformatted
    return Scores(rewards, correct, formatted, errors, timeouts, invalid)


def _finite_reward(out) -> float | None:
    """A grader's return value as a finite float; None when it is not one (scored 0 and counted invalid)."""
    try:
        r = float(out)
    except (TypeError, ValueError):
        return None
    return r if math.isfinite(r) else None


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
    checked = [_finite_reward(out) for out in s.rewards]
    rewards, invalid = [r or 0.0 for r in checked], s.invalid + sum(r is None for r in checked)
    correct = [r >= task.correct_threshold for r in rewards]
    parts = {k: [float(x) for x in s.parts.get(k, [0.0] * n)] for k in task.part_names}
    counts = {k: float(s.counts.get(k, 0.0)) for k in task.count_names}
    return Scores(rewards, correct, list(s.formatted), s.errors, s.timeouts, invalid, parts, counts)
