"""An ablation of any task's reward: each completion is graded against another problem's example, so the reward keeps
its scale and its spread within a group but says nothing about the question asked (the reasoning-gym demo's
ablation, scripts/demo_reasoning_gym.py). A task file a config names, like any user's (docs/extending.md):

    task: {name: scripts/shuffled_reward.py:ShuffledReward, args: {task: reasoning-gym/spell_backward, args: {...}}}
    data: {train: "task:train", eval: "task:heldout"}

The other problem is fixed per question: the split's problems in a seeded random order, each graded as the next one
in that cycle (never itself). Everything else (problems, prompts, the format check, maj@k classes) is the task's.
"""

from __future__ import annotations

import random

from rl_training.data.sources import Example
from rl_training.tasks.base import Task
from rl_training.tasks.build import make_task


class ShuffledReward(Task):
    def __init__(self, task: str, args: dict | None = None, seed: int = 0):
        self.inner = make_task(task, args or {})
        self.name = f"{self.inner.name} (shuffled reward)"
        self.correct_threshold = self.inner.correct_threshold
        self.seed = seed
        self._graded_as: dict = {}  # problem key -> the example its completions are graded against

    def examples(self, split: str) -> list[Example]:
        examples = self.inner.examples(split)
        order = sorted(examples, key=self.inner.problem_key)  # the split's own order may follow its seed
        random.Random(f"{self.seed}:{split}").shuffle(order)
        for ex, other in zip(order, order[1:] + order[:1], strict=True):
            self._graded_as[self.inner.problem_key(ex)] = other
        return examples

    def parse(self, record: dict, where: str) -> Example:
        return self.inner.parse(record, where)

    def problem_key(self, example: Example):
        return self.inner.problem_key(example)

    def render_prompt(self, example: Example, tokenizer, data) -> str:
        return self.inner.render_prompt(example, tokenizer, data)

    def reward(self, completion: str, example: Example) -> float:
        other = self._graded_as.get(self.inner.problem_key(example))
        if other is None:
            raise KeyError(f"{example.source}: not a problem of this task's splits (ShuffledReward reads task:SPLIT)")
        return self.inner.reward(completion, other)

    def has_answer(self, completion: str) -> bool:
        return self.inner.has_answer(completion)

    def answer_classes(self, completions, timeout_s: float = 5.0):
        return self.inner.answer_classes(completions, timeout_s)

    def start(self, ctx=None) -> None:
        self.inner.start(ctx)

    def close(self) -> None:
        self.inner.close()
