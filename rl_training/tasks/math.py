"""The math family: GSM8K ('#### N' answers) and MATH (\\boxed answers), graded by math-verify.

`math_reward`: math-verify (HF) equivalence of the completion's final answer (its last complete \\boxed{}, else its
'#### N' line, else the whole text) with the reference, parsed as one whole answer; number formatting normalised
on both sides first. The rules, stated once: docs/evaluation.md, "Grading rules"; the cases: the grading tests.
References are normalised once, when a record is parsed, so the grader receives the bare final answer:
- gsm8k: the text after the last '####', thousands separators removed ("1,234" -> "1234");
- math: the last \\boxed{...} of the answer/solution field, or the field itself when it has no \\boxed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from rl_training.data.sources import DataError, Example
from rl_training.tasks.base import Task, guarded

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.S)  # '\\x' is never a delimiter, whatever x is


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) whose braces close, stripped; None if there is none.

    Braces are matched, so '\\boxed{\\frac{1}{2}}' gives '\\frac{1}{2}'; escaped ones ('\\{', '\\}') do not
    count. A box left open (a completion cut off inside it) is passed over for the one before it.
    """
    contents = {m.end() for m in _BOX_OPEN.finditer(text)}  # where each box's content starts
    if not contents:
        return None
    # One pass from the first box, matching braces on a stack (a scan per box, each to the end of the text when
    # the box is left open, was quadratic: 4 s on 20,000 characters of '\\boxed{'). One pass reads escapes as
    # every per-box scan would: the character before a box's '{' is never a backslash, so a scan that started
    # earlier lands on that '{' too.
    open_at: list[int] = []  # for each unmatched '{': its box's content start, or -1 (not a box's)
    last: tuple[int, int] | None = None  # (content start, closing brace) of the last box that closed
    for tok in _BRACE_OR_ESCAPE.finditer(text, min(contents) - 1):
        if tok.group() == "{":
            open_at.append(tok.end() if tok.end() in contents else -1)
        elif tok.group() == "}" and open_at:
            start = open_at.pop()
            if start >= 0 and (last is None or start > last[0]):
                last = (start, tok.start())
    return None if last is None else text[last[0] : last[1]].strip()


def reference_of(fmt: str, answer: str, where: str) -> str:
    """The bare final answer of a gsm8k or math answer field (module docstring)."""
    if fmt == "gsm8k":
        if "####" not in answer:
            raise DataError(f"{where}: gsm8k answer has no '#### N' final answer: {answer[-80:]!r}")
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer.strip()


# ------------------------------------------------------------------------------------------------- graders
def _mv_parse(text: str):
    from math_verify import parse

    # Our own time limit wraps the call (tasks.base.time_limit); math-verify's alarm-based one would replace it.
    return parse(text, parsing_timeout=None)


# '#### N' as GSM8K writes it: the line must start like an answer (digit, sign, '.', '$', '\\', '('), so a
# markdown heading such as '#### Step 2: ...' is not taken for one. The blanks before and after the newline are
# one run each ('[ \t]*\n?[ \t]*' split a long blank run every way: 3 s on 20,000 blanks).
_HASH_ANSWER = re.compile(r"####[ \t]*(?:\n[ \t]*)?([-+.$€£¥₹\\(\d][^\n]*)")


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
# An \\hspace's length holds no brace: '[^}]*' scanned to the end of the text from every digit before an unclosed
# '\\hspace{' (quadratic: 4 s on 200,000 characters); '[^{}]*' stops at the next brace.
_LATEX_SPACING = r"~|\\[,;:>! ]|\\q?quad\b|\\thinspace\b|\\hspace\*?\{[^{}]*\}|\{,?\}"
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
# word needs 2+ letters, so '5 x' stays algebra. ('[A-Za-z]{2,}[A-Za-z'.-]*' split a long word every way: 7 s
# on 20,000 letters; '{2}' reads the same words.)
_NUMBER_THEN_WORDS = re.compile(
    r"((?:[-+]\s*)?(?:\\?\$\s*)?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\\frac\{\d+\}\{\d+\}|\s*/\s*\d+)?)"
    r"\s+[A-Za-z]{2}[A-Za-z'.-]*(?:\s+[A-Za-z][A-Za-z'.-]*)*"
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


def math_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by math-verify equivalence of the final answers `math_reward` grades: each answer
    joins the first earlier class whose representative it verifies equal to. No answer, or a parse that
    fails or times out, is None (it does not vote)."""
    from math_verify import verify

    reps: list = []
    out: list[int | None] = []
    for c in completions:
        pred = guarded(lambda c=c: math_answer(c), timeout_s, default=[])
        if not pred:
            out.append(None)
            continue
        for i, rep in enumerate(reps):
            if guarded(lambda rep=rep, pred=pred: verify(rep, pred, timeout_seconds=None), timeout_s, False):
                out.append(i)
                break
        else:
            reps.append(pred)
            out.append(len(reps) - 1)
    return out


class MathTask(Task):
    """gsm8k or math records ({question_key, answer_key}; data.question_key / data.answer_key), graded by
    `math_reward`, formatted when the completion commits to an answer, maj@k by math-verify equivalence."""

    reward_range = (0.0, 1.0)

    def __init__(
        self, fmt: Literal["gsm8k", "math"] = "math", question_key: str = "question", answer_key: str = "answer"
    ):
        if fmt not in ("gsm8k", "math"):
            raise ValueError(f"MathTask format must be gsm8k or math, got {fmt!r}")
        self.fmt, self.question_key, self.answer_key = fmt, question_key, answer_key

    def parse(self, record: dict, where: str) -> Example:
        ex = super().parse(record, where)
        return Example(ex.question, reference_of(self.fmt, ex.solution, where), ex.solution, where)

    def reward(self, completion: str, example: Example) -> float:
        return math_reward(completion, example.reference)

    def has_answer(self, completion: str) -> bool:
        return math_has_answer(completion)

    def answer_classes(self, completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
        return math_answer_classes(completions, timeout_s)
