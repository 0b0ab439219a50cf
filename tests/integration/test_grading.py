"""Math grading: number formatting read the way a careful human grader reads it, on both sides, and one grader
for every path that grades (training, the in-loop eval, evals.run).

The rules are stated in docs/evaluation.md ("Grading rules"); each case below gives the verdict a careful human
grader gives and why. More edge cases (units, several boxes, '#### N' with text after it) are in
tests/integration/test_evals.py; basic ones in tests/unit/tasks/test_data_rewards.py.
"""

from __future__ import annotations

import inspect
import re

import pytest

from rl_training.tasks.build import BUILTIN
from rl_training.tasks.math import math_reward, normalise_answer
from rl_training.tasks.reverse import ReverseTask
from tests.helpers import REPO

NNBSP = "\u202f"  # narrow no-break space: the SI thousands separator
MINUS = "\u2212"  # Unicode minus sign

CASES = [
    # --- thousands separators: LaTeX spacing and plain spaces between digit groups of three -----------------
    (r"\boxed{1\,234}", "1234", 1.0),  # thin space as a thousands separator (math-verify alone: 235)
    (r"\boxed{1\,234}", "235", 0.0),  # the old false positive: 1 + 234 must never match
    (r"\boxed{1{,}234}", "1234", 1.0),  # LaTeX's comma without its math spacing
    (r"\boxed{1\ 234}", "1234", 1.0),  # control space
    (r"\boxed{1 234}", "1234", 1.0),  # a plain space between groups of three
    (r"\boxed{1 234}", "235", 0.0),  # ... is never a sum
    (r"\boxed{1\;234}", "1234", 1.0),  # thick space, same rule
    (r"\boxed{1~234}", "1234", 1.0),  # a tie is a space too
    (f"\\boxed{{1{NNBSP}234}}", "1234", 1.0),  # Unicode narrow no-break space (SI style)
    (r"\boxed{1\,234\,567}", "1234567", 1.0),  # several groups
    (r"\boxed{1\,234\,567}", "802", 0.0),  # 1 + 234 + 567: never a sum
    (r"\boxed{1 234 567}", "1234567", 1.0),
    (r"\boxed{12 345}", "12345", 1.0),  # a first group of two digits
    (r"\boxed{-1\,234}", "-1234", 1.0),  # the sign stays with the joined number
    (r"\boxed{1\,234.5}", "1234.5", 1.0),  # decimals after grouped digits
    (r"\boxed{\$1\,234.50}", "1234.5", 1.0),  # currency, grouping and a trailing zero together
    (r"\boxed{1\,234}", "1,234", 1.0),  # a reference with a comma separator is the same number
    (r"\boxed{32\,348}", r"\$32,\!348", 1.0),  # MATH writes ',\!'; both sides normalised
    (r"\boxed{1\,234 pages}", "1234", 1.0),  # normalised before the unit-word rule
    ("#### 1 234", "1234", 1.0),  # the '#### N' line follows the same rule
    (r"\boxed{1\,234}", "1243", 0.0),  # near miss: digits transposed
    (r"\boxed{1\,000}", "1", 0.0),  # near miss: the separator is not a decimal point
    # --- numbers apart that are not thousands groups: no reading is the answer, the box scores 0 ----------------
    (r"\boxed{7 2}", "72", 0.0),  # '7 2' is not a way to write 72
    (r"\boxed{7 2}", "9", 0.0),  # nor 7 + 2 (math-verify alone: 9)
    (r"\boxed{7 2}", "14", 0.0),  # nor 7 x 2
    (r"\boxed{7\,2}", "72", 0.0),  # LaTeX spacing between digits that are not a group of three
    (r"\boxed{1 2345}", "12345", 0.0),  # a group of four is not a thousands group
    (r"\boxed{1 2345}", "2346", 0.0),  # ... and not a sum
    (r"\boxed{12\,34}", "1234", 0.0),  # a group of two after the first is not one either
    (r"\boxed{1\,23\,456}", "123456", 0.0),  # Indian lakh grouping with thin spaces: ambiguous here, 0
    (r"\boxed{3\quad 4}", "34", 0.0),  # a quad separates two answers, it does not join them
    (r"\boxed{3\quad 4}", "7", 0.0),
    ("#### 7 2", "72", 0.0),  # the same on the '#### N' line
    ("#### 7 2", "7", 0.0),  # ... and no other number of the text is taken instead
    ("Adding 7 + 2 = 9.\n#### 7 2", "9", 0.0),
    (r"\boxed{1{,}23}", "1.23", 0.0),  # a decimal comma is not read as a point
    (r"\boxed{1,5}", "1.5", 0.0),  # nor a plain one (it reads as the list 1, 5)
    (r"\boxed{1 1/2}", "1.5", 1.0),  # a mixed number is one number, not two apart
    (r"\boxed{1 1/2}", "2", 0.0),  # ... and not 1 + 1 or 11/2
    (r"\boxed{-2 3/4}", "-2.75", 1.0),  # the sign covers the whole mixed number (math-verify alone: -3/2)
    (r"\boxed{1 1/2 cups}", "1.5", 1.0),  # then a unit word
    (r"\boxed{2 \sqrt{3}}", r"2\sqrt{3}", 1.0),  # a space before a command is no split
    # --- percent: a percent sign is dropped and the number is compared as written -----------------------------
    (r"\boxed{12.5\%}", "12.5", 1.0),  # math-verify alone reads 0.125 (floats only; '50\%' works)
    (r"\boxed{33.33\%}", "33.33", 1.0),
    (r"\boxed{12.5%}", "12.5", 1.0),  # '%' without the backslash
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50}", r"50\%", 1.0),  # a reference with the sign, an answer without it
    (r"\boxed{12.5}", r"12.5\%", 1.0),
    (r"\boxed{0.5\%}", "0.5", 1.0),
    (r"\boxed{10\%}", r"10\%", 1.0),
    ("#### 18%", "18", 1.0),
    (r"\boxed{12.5 \text{%}}", "12.5", 1.0),  # the sign inside \text{}
    (r"\boxed{0.125}", "12.5", 0.0),  # the rule: never by the fraction's value (0.125 is not 12.5)
    (r"\boxed{12.5\%}", "0.125", 0.0),  # ... either way round
    (r"\boxed{50\%}", "0.5", 0.0),  # ... integer percents too (math-verify alone: 1)
    (r"\boxed{0.5}", r"50\%", 0.0),
    (r"\boxed{12.5\%}", "12.6", 0.0),  # near miss
    # --- a trailing decimal point ---------------------------------------------------------------------------
    (r"\boxed{1234.}", "1234", 1.0),  # math-verify alone: text, 0
    (r"\boxed{5.}", "5", 1.0),
    ("#### 1234.", "1234", 1.0),
    (r"\boxed{123.4}", "1234", 0.0),  # near miss: a point inside the number is a decimal point
    (r"\boxed{1234.}", "12340", 0.0),
    # --- Unicode minus and dash look-alikes ---------------------------------------------------------------
    (f"\\boxed{{{MINUS}5}}", "-5", 1.0),  # U+2212
    (f"#### {MINUS}5", "-5", 1.0),  # math-verify alone: no answer (and '#### ' did not take it)
    ("\\boxed{\u20135}", "-5", 1.0),  # en dash
    ("\\boxed{\u2012 5}", "-5", 1.0),  # figure dash
    (r"\boxed{-5}", f"{MINUS}5", 1.0),  # a reference with the Unicode sign
    (f"\\boxed{{{MINUS}5}}", "5", 0.0),  # near miss: the sign still counts
    (f"\\boxed{{3 {MINUS} 5}}", "-2", 1.0),  # a Unicode minus between terms is a minus
    ("#### 72 \u2014 the total", "72", 1.0),  # a dash in text after the answer does not subtract from it
    # --- currency signs --------------------------------------------------------------------------------------
    (r"\boxed{\$18}", "18", 1.0),
    (r"\boxed{€18}", "18", 1.0),  # math-verify alone: text, 0
    (r"\boxed{£18}", "18", 1.0),
    (r"\boxed{18€}", "18", 1.0),  # a sign after the number
    (r"\boxed{\euro 18}", "18", 1.0),
    ("#### €18", "18", 1.0),
    ("#### $1,234", "1234", 1.0),
    (r"\boxed{-\$5}", "-5", 1.0),  # a loss of five dollars
    (r"\boxed{€19}", "18", 0.0),  # near miss
    # --- MATH-style answers that must pass through unchanged -----------------------------------------------
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),  # a tuple's order counts
    (r"\boxed{[1, 3]}", "[1,3]", 1.0),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", 1.0),  # rows
    (r"\boxed{10^{3}}", "1000", 1.0),
    (r"\boxed{3\sqrt{13}}", r"3\sqrt{13}", 1.0),
    (r"\boxed{3}", r"3\sqrt{13}", 0.0),  # near miss: the first number of the reference is not the answer
    ("The answer is 72.", "72", 1.0),  # no box, no '####': math-verify's extraction, sentence point ignored
    # --- no box, no '#### N': the whole text, with the same thousands rule for LaTeX separators -------------------
    (r"The answer is $1\,234$.", "1234", 1.0),
    (r"The answer is $1\,234$.", "235", 0.0),  # math-verify alone: 235
    (r"The answer is $7\,2$.", "9", 0.0),  # LaTeX spacing between digits: no reading
    ("The answer is 7 2", "9", 0.0),  # plain spaces in running text: math-verify sums nothing there
    ("The answer is 1 234", "1234", 1.0),
    ("The answer is \u22125", "-5", 1.0),
    (r"\boxed{72.5}", "72", 0.0),
]


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_grading_table(completion, reference, expected):
    assert math_reward(completion, reference) == expected


def test_table_is_large_and_keeps_near_misses():
    assert len(CASES) >= 60
    assert sum(e == 0.0 for _, _, e in CASES) >= 25  # wrong answers that look right must stay wrong


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"1\,234\,567", "1234567"),
        (r"\$1 234.50", "1234.50"),
        (r"12.5\%", "12.5"),
        (f"{MINUS}1{NNBSP}000.", "-1000"),
        (r"7 2", None),  # no reading
        (r"1 1/2", r"1\frac{1}{2}"),  # a mixed number, in the form math-verify reads as 3/2
        (r"x^2 + 1", "x^2 + 1"),  # no numbers apart: untouched
        (r"\frac{1}{2}", r"\frac{1}{2}"),
    ],
)
def test_normalise_answer_values(text, expected):
    assert normalise_answer(text) == expected


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_normalisation_is_idempotent_and_symmetric(completion, reference, expected):
    """Normalising twice changes nothing; a plain reference boxed as an answer grades like the reference."""
    once = normalise_answer(reference)
    assert once is None or normalise_answer(once) == once
    if re.fullmatch(r"-?\d+(\.\d+)?", reference):
        assert math_reward(rf"\boxed{{{reference}}}", reference) == 1.0


# ------------------------------------------------------------------------------------- one grader everywhere
def test_only_the_math_task_imports_math_verify():
    """Nothing but rl_training/tasks/math.py grades math: no second grader can drift from it. (The device check's
    preflight only reports the installed version by name, through importlib.)"""
    users = [
        p.relative_to(REPO).as_posix()
        for d in ("rl_training", "evals", "scripts")
        for p in (REPO / d).rglob("*.py")
        if re.search(r"^\s*(from|import) math_verify\b", p.read_text(), re.M)
    ]
    assert users == ["rl_training/tasks/math.py"]


def test_training_inloop_eval_and_evals_run_call_the_one_grader(run_overrides, monkeypatch, tmp_path):
    """A spy built in place of the reverse task sees the calls of each path: the training step, the in-loop eval
    and evals.run all get their grader from the one builder (the synthetic task here: the tiny model speaks it)."""
    from evals import run as evals_run
    from rl_training.runners import rl_runner

    callers: set[str] = set()

    class Spy(ReverseTask):
        def reward(self, completion, example):
            names = {f.frame.f_code.co_qualname for f in inspect.stack()[1:12]}
            callers.update(names & {"rl_step", "InLoopEval.__call__", "run_evals"})
            return super().reward(completion, example)

    monkeypatch.setitem(BUILTIN, "reverse", lambda cfg, args: Spy(cfg.data.question_key, cfg.data.answer_key))
    over = [*run_overrides, "train.total_steps=1", "ckpt.every=1", "eval.every=1", "eval.num_prompts=4"]
    over += ["eval.num_samples=2", "eval.ks=[1,2]"]
    assert rl_runner.main(["--cfg", str(REPO / "cfg" / "testconfig.yaml"), *over]) == 0
    assert callers == {"rl_step", "InLoopEval.__call__"}  # training, then the in-loop eval
    run_dir = tmp_path / "runs" / "testconfig"
    assert evals_run.main(["--run-dir", str(run_dir), "--backend", "hf", "--no-base", "--limit", "4"]) == 0
    assert callers == {"rl_step", "InLoopEval.__call__", "run_evals"}
