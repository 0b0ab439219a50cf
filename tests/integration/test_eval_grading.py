"""The graders evals and training share (rl_training/tasks/math.py) on edge cases and data files, and one grader and
one prompt template for training, the in-loop eval and evals.run."""

from __future__ import annotations

import shutil

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.data.sources import load_examples
from rl_training.evaluation.evaluate import EvalSettings, InLoopEval, evaluate_policy, load_eval_set
from rl_training.runners import rl_batch, rl_runner
from rl_training.tasks.build import make_task
from rl_training.tasks.math import math_answer_classes, math_has_answer, math_reward
from tests.helpers import FIXTURES, TESTCFG, CannedBackend

GSM8K = FIXTURES / "gsm8k_test_sample.jsonl"
MATH500 = FIXTURES / "math500_sample.jsonl"


# ---------------------------------------------------------------------------------------------- grading
@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        # LaTeX fractions, either side
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{\tfrac34}", r"\frac{3}{4}", 1.0),
        (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        # commas in numbers
        ("The answer is 1,234.", "1234", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("#### 1,234,567", "1234567", 1.0),
        ("#### 1,235", "1234", 0.0),
        # units and currency
        ("The total is $18.", "18", 1.0),
        ("#### $18", "18", 1.0),
        ("She makes 18 dollars", "18", 1.0),
        ("#### 18 dollars", "18", 1.0),
        (r"\boxed{\$18}", "18", 1.0),
        (r"\boxed{18 \text{ dollars}}", "18", 1.0),
        (r"\boxed{5\text{ cm}}", "5", 1.0),
        ("#### 18%", "18", 1.0),
        # a bare unit word in the box: the number is graded (math-verify alone reads '18 dollars' as 18*d*o*...)
        (r"\boxed{18 dollars}", "18", 1.0),
        (r"\boxed{18 dollars}", "19", 0.0),  # ... and still compared
        (r"\boxed{12 cookies}", "12", 1.0),
        (r"\boxed{3 books}", "3", 1.0),
        (r"\boxed{1,234 pages}", "1234", 1.0),
        (r"\boxed{40 people}", "40", 1.0),
        (r"\boxed{-6 eggs}", "-6", 1.0),
        (r"\boxed{2.5 points}", "2.5", 1.0),
        (r"\boxed{7 weeks}", "7", 1.0),
        (r"\boxed{\$15 per hour.}", "15", 1.0),
        (r"\boxed{1/2 cup}", "0.5", 1.0),
        (r"\boxed{9 blue marbles}", "9", 1.0),
        (r"\boxed{5 x}", "5", 0.0),  # one letter is algebra: 5x, not 5
        (r"\boxed{x^2}", "x^2", 1.0),
        (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
        # several boxes: the last complete one alone (math-verify alone grades {5, 7} as a set)
        (r"First guess \boxed{5}. Wait: \boxed{7}", "7", 1.0),
        (r"First guess \boxed{5}. Wait: \boxed{7}", "5", 0.0),
        (r"$\boxed{2}$, no: $\boxed{\frac{1}{2}}$", "0.5", 1.0),  # braces matched through \frac{1}{2}
        (r"\boxed{\{1, 2\}} or maybe \boxed{3}", "3", 1.0),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}", 1.0),  # escaped braces do not close the box
        (r"So \boxed{5}. Or \boxed{1", "5", 1.0),  # a box cut off by the token limit is passed over
        (r"#### 4 then \boxed{9}", "9", 1.0),  # a complete box beats '#### N'
        (r"\fbox{7}", "7", 1.0),
        # trailing text after the answer
        (r"The answer is \boxed{72}. Check: 70 + 2 = 72, and 5 is not it.", "72", 1.0),
        ("#### 72 apples.", "72", 1.0),
        ("#### 72\n\nQuestion: Tom has 99 marbles", "72", 1.0),  # text generated after the answer
        ("So 72 is wrong, it is 73\n#### 73\nDone after 2 checks", "72", 0.0),
        ("#### 72.00", "72", 1.0),
        ("#### Step 1: 70 + 2\nSo the total is 72", "72", 1.0),  # a markdown heading is not '#### N'
        ("#### Final answer\nThe answer is 72", "72", 1.0),
        ("I don't know", "72", 0.0),
    ],
)
def test_math_grader_edge_cases(completion, reference, expected):
    assert math_reward(completion, reference) == expected


@pytest.mark.parametrize(
    "reference, right, wrong",
    [
        # MATH answers are bare LaTeX: parsed as a whole, not as their first number.
        (r"2\sqrt{13}", r"\boxed{2\sqrt{13}}", r"\boxed{2}"),
        ("5 - 5i", r"\boxed{5-5i}", r"\boxed{5}"),
        ("2^{10}", r"\boxed{1024}", r"\boxed{2}"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}", r"\boxed{3}"),
        (r"\text{Evelyn}", r"\boxed{\text{Evelyn}}", r"\boxed{\text{Bob}}"),
        (r"\$32,\!348", r"\boxed{32348}", r"\boxed{32}"),
        ("p - q", r"\boxed{p-q}", r"\boxed{q-p}"),
    ],
)
def test_math_reference_is_a_whole_answer(reference, right, wrong):
    assert math_reward(right, reference) == 1.0
    assert math_reward(wrong, reference) == 0.0


def test_format_check_and_answer_classes():
    assert math_has_answer("#### 5") and math_has_answer(r"so \boxed{5}") and not math_has_answer("it is 5")
    # 0.5 and 1/2 are one vote; no answer does not vote; '#### 3' and '3.0 apples' agree
    texts = ["#### 0.5", r"\boxed{\frac12}", "no idea", "#### 3", "#### 3.0 apples\nthen 99", ""]
    assert math_answer_classes(texts) == [0, 0, None, 1, 1, None]
    # votes use the graded answer too: the last box (7, not {5, 7}), the number before a unit word
    texts = [r"\boxed{5}. Wait: \boxed{7}", "#### 7", r"\boxed{7 dollars}", r"\boxed{5}"]
    assert math_answer_classes(texts) == [0, 0, 0, 1]
    assert make_task("reverse").answer_classes([" ab", "ab ", "", "ba"], 1.0) == [0, 0, None, 1]


def test_gsm8k_and_math500_files(tmp_path, monkeypatch):
    gsm = load_examples(str(GSM8K), make_task("gsm8k").parse)
    assert [e.reference for e in gsm] == ["18", "3", "1234", "13.5"]  # '#### 1,234' -> '1234'
    # MATH-500's `answer` field is taken as it is; the `solution` field gives its last \boxed: the same answer.
    by_answer = load_examples(str(MATH500), make_task("math", {"question_key": "problem"}).parse)
    solution = make_task("math", {"question_key": "problem", "answer_key": "solution"})
    by_solution = load_examples(str(MATH500), solution.parse)
    assert [e.reference for e in by_answer] == [e.reference for e in by_solution]
    assert by_answer[0].reference == r"\left( 3, \frac{\pi}{2} \right)"
    for e in by_answer:
        assert math_reward(f"The answer is $\\boxed{{{e.reference}}}$.", e.reference) == 1.0
    # A `datasets` name 'name@split' (here a local dataset directory, read by `datasets` offline).
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "math500").mkdir()
    shutil.copy(MATH500, tmp_path / "math500" / "test.jsonl")
    hub = load_examples(f"{tmp_path / 'math500'}@test", make_task("math", {"question_key": "problem"}).parse)
    assert [e.reference for e in hub] == [e.reference for e in by_answer]


# ------------------------------------------------------------------------- one grader, one template
def test_eval_and_training_grade_and_prompt_identically(run_overrides, monkeypatch):
    """The training step and the eval see the same prompt ids for a question and give a completion the same
    reward, correctness and format verdict."""
    data = [f"data.train={GSM8K}", f"data.eval={GSM8K}", "task.name=gsm8k", "data.max_prompt_tokens=512"]
    cfg = load_config(TESTCFG, [*run_overrides, *data, "data.prompt_template=Q: {question}\nA:"])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        answers = ["#### 18", "She makes $18 a day.", "#### 1,234", r"\boxed{13.50} dollars", "#### 3\nthen 99", "7"]
        canned = CannedBackend(run.tokenizer, {tuple(p): answers for p in run.prompts})
        run.backend = canned
        graded = {}
        real_score = rl_batch.score_completions

        def recording_score(task, texts, examples, timeout_s):
            s = real_score(task, texts, examples, timeout_s)
            for t, ex, *v in zip(texts, examples, s.rewards, s.correct, s.formatted, strict=True):
                graded[(t, ex.reference)] = tuple(v)
            return s

        monkeypatch.setattr(rl_batch, "score_completions", recording_score)
        rl_runner.rl_step(run, 0)
        train_prompts = list(canned.seen)
        assert len(graded) > 4 and any(v[1] for v in graded.values()) and not all(v[1] for v in graded.values())

        canned.seen = []
        # The prompts as evals.run and the in-loop eval build them, not re-encoded here.
        examples, eval_prompts = load_eval_set(cfg, run.tokenizer, run.task)
        assert InLoopEval(cfg, run.tokenizer, run.info, run.derived.run_dir, run.task).prompts == eval_prompts
        es = EvalSettings.from_config(load_config(None, ["eval.num_samples=6", "eval.ks=[1]"]))
        records, _ = evaluate_policy(canned, eval_prompts, examples, run.task, es)
        assert len(examples) == 4 and all(tuple(p) in {tuple(q) for q in run.prompts} for p in canned.seen)
        assert {tuple(p) for p in train_prompts} <= {tuple(p) for p in canned.seen}  # one template
        in_eval = {
            (s["text"], r["reference"]): (s["reward"], s["correct"], s["formatted"])
            for r in records
            for s in r["samples"]
        }
        for key, verdict in graded.items():
            assert in_eval[key] == verdict, key
    finally:
        run.logger.close()
