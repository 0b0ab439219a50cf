"""reasoning-gym's datasets by name (rl_training/tasks/reasoning_gym.py): generated train and held-out splits that are
disjoint and fixed by their seeds, read through the data spec 'task:SPLIT'; the dataset's own score_answer as the
reward, partial credit kept; a weighted composite; and every bad name or argument as one ConfigError line."""

from __future__ import annotations

import collections
import json
import sys
import time

import pytest
from hypothesis import given

from rl_training.config.schema import ConfigError
from rl_training.data.sources import DataError, load_examples, synthesized_row
from rl_training.tasks.base import score_completions
from rl_training.tasks.build import make_task
from rl_training.tasks.reasoning_gym import ReasoningGymTask
from tests.hostile import HOSTILE_TEXT

SPELL = "reasoning-gym/spell_backward"


def spell(**args) -> ReasoningGymTask:
    return make_task(SPELL, {"size": 40, "heldout_size": 10, **args})


def test_splits_are_disjoint_and_fixed_by_their_seeds():
    task = spell()
    train, held = load_examples("task:train", task.parse), load_examples("task:heldout", task.parse)
    assert len(held) == 10 and len(train) == 40 - task.overlap_dropped
    assert not {e.question for e in train} & {e.question for e in held}
    again = spell()
    assert [e.question for e in load_examples("task:train", again.parse)] == [e.question for e in train]
    other = spell(seed=7)
    assert [e.question for e in load_examples("task:train", other.parse)] != [e.question for e in train]
    # the held-out set does not move when the train split grows
    bigger = spell(size=80)
    assert [e.question for e in bigger.examples("heldout")] == [e.question for e in held]
    assert [e.question for e in load_examples("task:heldout", task.parse, limit=3)] == [e.question for e in held[:3]]


def test_a_train_problem_that_is_held_out_too_is_dropped():
    # 3-letter words from the same seed in both splits: every held-out problem is also a train problem
    task = spell(size=30, heldout_size=5, heldout_seed=0, min_word_len=3, max_word_len=3)
    train, held = task.examples("train"), task.examples("heldout")
    assert task.overlap_dropped >= 5 and len(train) == 30 - task.overlap_dropped
    assert not {e.question for e in train} & {e.question for e in held}


def test_a_validation_split_is_disjoint_from_both_and_moves_neither():
    # the validation split drawn with the train split's seed: its 20 problems are train's first 20, all dropped there
    args = {"size": 60, "heldout_size": 20, "min_word_len": 3, "max_word_len": 3}
    plain, valid = spell(**args), spell(**args, valid_size=20, valid_seed=0)
    held, val, train = (valid.examples(s) for s in ("heldout", "valid", "train"))
    q = lambda exs: {e.question for e in exs}  # noqa: E731
    assert not q(held) & q(val) and not q(held) & q(train) and not q(val) & q(train)
    assert [e.question for e in held] == [e.question for e in plain.examples("heldout")]  # the reported set stays
    # train is the plain task's train without the validation problems, in the same order
    assert [e.question for e in train] == [e.question for e in plain.examples("train") if e.question not in q(val)]
    assert len(val) + len(train) + valid.overlap_dropped == 20 + 60  # every drop is counted
    assert valid.overlap_dropped >= 20
    assert [e.question for e in load_examples("task:valid", valid.parse)] == [e.question for e in val]
    with pytest.raises(DataError, match="task.args.valid_size"):
        plain.examples("valid")


def test_the_dataset_is_reasoning_gyms_own_at_the_same_seed():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("spell_backward", size=5, seed=3, max_word_len=6)
    task = make_task(SPELL, {"size": 5, "seed": 3, "max_word_len": 6, "answer_format": "plain"})
    assert [e.question for e in task.examples("train")] == [x["question"] for x in ds]
    assert [e.solution for e in task.examples("train")] == [x["answer"] for x in ds]  # the SFT target


def test_score_answer_grades_with_its_partial_credit():
    task = spell()
    ex = task.examples("train")[0]
    word = ex.reference  # e.g. 'cimho': one letter short scores (n-1)/n with spell_backward's own score_answer
    completions = [ex.solution, f"thinking... <answer>{word[:-1]}</answer>", word, ""]
    s = score_completions(task, completions, [ex] * 4, timeout_s=5.0)
    assert s.rewards == pytest.approx([1.0, (len(word) - 1) / len(word), 0.0, 0.0])
    assert s.correct == [True, False, False, False] and s.formatted == [True, True, False, False]
    assert ex.solution == f"<answer>{word}</answer>" and "<answer>" in ex.question

    plain = spell(answer_format="plain")
    pex = plain.examples("train")[0]
    assert pex.solution == pex.reference and "<answer>" not in pex.question
    s = score_completions(plain, [f" {pex.reference}\n", pex.reference[:-1]], [pex] * 2, timeout_s=5.0)
    assert s.rewards == pytest.approx([1.0, (len(pex.reference) - 1) / len(pex.reference)])


def test_votes_are_by_the_extracted_answer():
    task = spell()
    assert task.answer_classes(["a <answer>x</answer>", "b <answer>x</answer>", "<answer>y</answer>", "none"]) == [
        0,
        0,
        1,
        None,
    ]


def test_composite_draws_by_weight_and_grades_each_by_its_dataset():
    args = {"datasets": {"spell_backward": {"weight": 3, "max_word_len": 5}, "letter_counting": None}, "size": 400}
    task = make_task("reasoning-gym", args)
    counts = collections.Counter(e.meta["entry"]["metadata"]["source_dataset"] for e in task.examples("train"))
    assert set(counts) == {"spell_backward", "letter_counting"}
    assert 2.3 < counts["spell_backward"] / counts["letter_counting"] < 4.0  # 3:1 drawn
    by = {e.meta["entry"]["metadata"]["source_dataset"]: e for e in task.examples("heldout")}
    s = score_completions(task, [by["spell_backward"].solution, by["letter_counting"].solution], list(by.values()), 5.0)
    assert s.rewards == [1.0, 1.0]
    assert task.weights == {"spell_backward": 3.0, "letter_counting": 1.0}


def test_a_synthesized_row_and_a_saved_entry_are_read_back(tmp_path):
    task = spell()
    ex = task.examples("train")[0]
    path = tmp_path / "rows.jsonl"
    entry = ex.meta["entry"]
    path.write_text(json.dumps(synthesized_row(ex, ex.solution)) + "\n" + json.dumps(entry) + "\n")
    synth, saved = load_examples(str(path), task.parse)
    assert synth.solution == ex.solution and saved.question == ex.question
    assert task.reward(ex.solution, saved) == 1.0
    path.write_text(json.dumps({"question": "abc", "answer": "cba"}) + "\n")  # a reverse record: not an entry
    with pytest.raises(DataError, match="task:train"):
        load_examples(str(path), task.parse)


def test_a_task_that_makes_no_splits_says_so():
    with pytest.raises(DataError, match="MathTask makes no problems of its own"):
        load_examples("task:train", make_task("gsm8k").parse)
    with pytest.raises(DataError, match="makes the splits train, valid, heldout"):
        load_examples("task:test", spell().parse)


@pytest.mark.parametrize(
    "name, args, message",
    [
        (
            "reasoning-gym/spel_backward",
            {},
            "task.name='reasoning-gym/spel_backward': reasoning-gym has no dataset 'spel_backward' "
            "(close: spell_backward",
        ),
        ("reasoning-gym/composite", {}, "a composite is task.name: reasoning-gym with task.args.datasets"),
        (SPELL, {"max_len": 3}, "spell_backward has no setting max_len (it takes min_word_len, max_word_len"),
        (SPELL, {"min_word_len": 0}, "spell_backward: min_word_len must be positive"),
        (SPELL, {"answer_format": "json"}, "answer_format must be one of tag, plain"),
        (SPELL, {"size": 0}, "size must be an integer >= 1"),
        (SPELL, {"valid_size": -1}, "valid_size must be an integer >= 0"),
        ("reasoning-gym", {}, "name the datasets"),
        ("reasoning-gym", {"datasets": {"spell_backwards": {}}}, "no dataset 'spell_backwards' (close: spell_backward"),
        ("reasoning-gym", {"datasets": {"spell_backward": {"weight": -1}}}, "weight must be a positive number"),
        ("reasoning-gym", {"datasets": {"spell_backward": {"seed": 3}}}, "'seed' belongs to the splits"),
        ("reasoning_gym/spell_backward", {}, "is not a built-in task (gsm8k"),
    ],
)
def test_bad_names_and_args_are_one_line(name, args, message):
    with pytest.raises(ConfigError) as e:
        make_task(name, args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_without_the_package_the_name_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an environment without the requirement sees
    with pytest.raises(ConfigError) as e:
        make_task(SPELL)
    assert str(e.value).startswith(f"task.name={SPELL!r} needs the reasoning-gym package") and "\n" not in str(e.value)


# ------------------------------------------------------------------------- model-written text (issue 38's rule)
@given(HOSTILE_TEXT)
def test_the_answer_is_reasoning_gyms_own_extraction_and_grading_is_total(text):
    from reasoning_gym.utils import extract_answer

    task = spell()
    assert task.answer(text) == extract_answer(text)  # the same pairs, found in one pass
    ex = task.examples("heldout")[0]
    scores = score_completions(task, [text, f"{text}</answer><answer>{ex.reference}</answer>"], [ex, ex], timeout_s=5.0)
    assert 0.0 <= scores.rewards[0] <= 1.0 and scores.errors == scores.timeouts == scores.invalid == 0
    # a closed answer at the end is graded, whatever the model wrote before it (an unclosed tag in `text` pairs
    # with the first closing tag: the added one)
    assert scores.rewards[1] == 1.0


def test_many_unclosed_answer_tags_are_one_pass():
    # reasoning_gym.utils.extract_answer takes 8-14 s on these 90,000 characters (it rescans the rest of the text
    # from every unclosed tag: quadratic, 0.5 s at 20,000); ours reads them once (~1 ms). The bound is loose for a
    # busy machine, and on this thread's CPU time (a call waiting for its core is not work), as in
    # test_fuzz_graders.py.
    task, text = spell(), "<answer>x" * 10_000
    t0 = time.thread_time()
    assert task.answer(text) is None
    assert time.thread_time() - t0 < 0.5
