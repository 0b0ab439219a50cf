"""The reasoning-gym demo's ablation task (scripts/shuffled_reward.py): a task file like a user's, whose every
completion is graded against another problem of its split, fixed per question; problems, prompts and the format
check are the wrapped task's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_training.tasks.base import score_completions
from rl_training.tasks.build import make_task

ABLATION = f"{Path(__file__).resolve().parents[3] / 'scripts' / 'shuffled_reward.py'}:ShuffledReward"
SPELL = {"task": "reasoning-gym/spell_backward", "args": {"size": 30, "heldout_size": 8, "answer_format": "plain"}}


def shuffled(**over):
    return make_task(ABLATION, {**SPELL, **over})


def test_each_problem_is_graded_as_another_fixed_one_of_its_split():
    task, inner = shuffled(), make_task(SPELL["task"], SPELL["args"])
    for split in ("train", "heldout"):
        problems = task.examples(split)
        assert [e.question for e in problems] == [e.question for e in inner.examples(split)]  # the task's own
        by_question = {e.question: e for e in problems}
        graded_as = {}
        for ex in problems:
            # the right answer scores 1 only against its own problem; spell_backward's partial credit counts
            # matching letters, so the answer the shuffled grader pays 1 for is the other problem's
            (other,) = [o for o in problems if task.reward(o.solution, ex) == 1.0]
            assert other.question != ex.question
            graded_as[ex.question] = other.question
        # a cycle over the whole split: every problem is some other problem's target exactly once
        assert sorted(graded_as.values()) == sorted(by_question)
        assert all(task.reward(ex.solution, ex) < 1.0 for ex in problems)


def test_the_order_is_fixed_by_the_seed():
    def targets(task):
        problems = task.examples("train")
        return [next(o.question for o in problems if task.reward(o.solution, ex) == 1.0) for ex in problems]

    assert targets(shuffled()) == targets(shuffled())
    assert targets(shuffled()) != targets(shuffled(seed=1))


def test_format_check_and_batch_grading_are_the_wrapped_tasks():
    task = shuffled()
    ex = task.examples("heldout")[0]
    scores = score_completions(task, [ex.solution, "   "], [ex, ex], timeout_s=5.0)
    assert scores.formatted == [True, False]  # plain answers: any non-blank completion commits to one
    assert scores.rewards[0] < 1.0 and scores.rewards[1] == 0.0


def test_a_problem_from_outside_its_splits_is_an_error_not_a_silent_zero():
    task, other = shuffled(), make_task(SPELL["task"], {**SPELL["args"], "seed": 99, "heldout_seed": 98})
    task.examples("train")
    stray = next(e for e in other.examples("train") if e.question not in {x.question for x in task.examples("train")})
    with pytest.raises(KeyError, match="not a problem of this task's splits"):
        task.reward(stray.solution, stray)
