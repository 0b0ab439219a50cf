"""reasoning-gym's procedural datasets as built-in tasks (docs/extending.md): problems generated on the fly from
a seed, graded by each dataset's own `score_answer` (its partial credit kept).

    task: {name: reasoning-gym/spell_backward, args: {max_word_len: 6, size: 2000}}
    task: {name: reasoning-gym, args: {datasets: {spell_backward: {weight: 2}, letter_counting: {weight: 1}}}}
    data: {train: "task:train", eval: "task:heldout"}     # the task's own splits (data/sources.py)

The train split is `size` problems from `seed`, the held-out split `heldout_size` from `heldout_seed`, and, with
`valid_size`, a validation split (`task:valid`: what a warm start's skill gate or model selection reads, never the
reported held-out set) of so many from `valid_seed`. A train problem whose question is also held out or in the
validation split, and a validation problem also held out, is dropped (`overlap_dropped`), so the splits are
disjoint whatever a dataset's seeding. One name is reasoning-gym's `create_dataset(name, size=, seed=,
**settings)` exactly (the same seed gives the problems its authors report on); `reasoning-gym` with `datasets` is
its CompositeDataset (each problem drawn from one dataset by weight).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from rl_training.data.sources import DataError, Example
from rl_training.data.text import last_tagged
from rl_training.tasks.base import Task, exact_answer_classes

FAMILY = "reasoning-gym"
SPLITS = ("train", "valid", "heldout")
HELDOUT_SEED = 1_000_000_000  # far from any train seed range, and fixed: a longer train split keeps its held-out set
VALID_SEED = 2_000_000_000  # far from both
ANSWER_FORMATS = ("tag", "plain")
TAG_INSTRUCTION = "Give only your final answer, between <answer> and </answer>."


class UnknownDataset(ValueError):
    """A dataset name reasoning-gym does not have (the message lists the closest names)."""


def dataset_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")  # 'composite' is the `reasoning-gym` name's


def check_dataset(name: str) -> None:
    names = dataset_names()
    if name == "composite":
        raise UnknownDataset(f"a composite is task.name: {FAMILY} with task.args.datasets (docs/extending.md)")
    if name not in names:
        close = difflib.get_close_matches(name, names, n=4, cutoff=0.5)
        hint = f"close: {', '.join(close)}" if close else f"{len(names)} datasets, e.g. {', '.join(names[:4])}"
        raise UnknownDataset(f"{FAMILY} has no dataset {name!r} ({hint}; docs/extending.md)")


def _settings(name: str, settings: Any) -> dict:
    if not isinstance(settings, dict):
        raise ValueError(f"the settings of {name!r} must be a mapping, got {type(settings).__name__}")
    for key in ("seed", "size"):
        if key in settings:
            raise ValueError(
                f"{name}: {key!r} belongs to the splits (task.args size, seed, heldout_size, heldout_seed, "
                "valid_size, valid_seed)"
            )
    return settings


def _create(name: str, size: int, seed: int, settings: dict):
    """reasoning_gym.create_dataset, its refusals (an unknown setting, an assert in its validate) as ValueError."""
    import dataclasses

    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
    except TypeError:
        takes = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
        unknown = sorted(set(settings) - set(takes))
        raise ValueError(f"{name} has no setting {', '.join(unknown)} (it takes {', '.join(takes)})") from None
    except AssertionError as e:  # reasoning-gym validates its configs with assert
        raise ValueError(f"{name}: {e or 'its settings are out of range'}") from None


class ReasoningGymTask(Task):
    """One reasoning-gym dataset, or a weighted composite of several (`datasets`: name -> {weight, settings})."""

    reward_range = (0.0, 1.0)
    correct_threshold = 1.0  # reward 1.0 is score_answer's exact answer; below it is partial credit

    def __init__(
        self,
        datasets: dict[str, dict],
        composite: bool = False,
        size: int = 1000,
        seed: int = 0,
        heldout_size: int = 100,
        heldout_seed: int = HELDOUT_SEED,
        answer_format: str = "tag",
        valid_size: int = 0,
        valid_seed: int = VALID_SEED,
    ):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
        for key, v, least in (("size", size, 1), ("heldout_size", heldout_size, 1), ("valid_size", valid_size, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"{key} must be an integer >= {least}, got {v!r}")
        for key, v in (("seed", seed), ("heldout_seed", heldout_seed), ("valid_seed", valid_seed)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
        if not isinstance(datasets, dict) or not datasets:
            raise ValueError("datasets must name at least one dataset: {name: {weight: 1, ...its settings}}")
        self.answer_format = answer_format
        self.sizes = {"train": (size, seed), "heldout": (heldout_size, heldout_seed)}
        self.sizes |= {"valid": (valid_size, valid_seed)} if valid_size else {}
        self.overlap_dropped = 0  # train and validation problems dropped because a later split has them
        self._splits: dict[str, list[Example]] = {}
        if composite:
            from reasoning_gym.composite import DatasetSpec

            specs = []
            for name, entry in datasets.items():
                check_dataset(name)
                settings = dict(_settings(name, entry if entry is not None else {}))
                weight = settings.pop("weight", 1.0)
                if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
                    raise ValueError(f"{name}: weight must be a positive number, got {weight!r}")
                _create(name, 1, 0, settings)  # each dataset's settings checked by name
                specs.append(DatasetSpec(name=name, weight=float(weight), config=settings))
            self.weights = {s.name: s.weight for s in specs}
            self._datasets = {
                split: _create("composite", n, s, {"datasets": specs}) for split, (n, s) in self.sizes.items()
            }
        else:
            ((name, settings),) = datasets.items()
            check_dataset(name)
            self.weights = {name: 1.0}
            self._datasets = {
                split: _create(name, n, s, _settings(name, settings)) for split, (n, s) in self.sizes.items()
            }
        self.name = FAMILY if composite else f"{FAMILY}/{next(iter(datasets))}"

    # ------------------------------------------------------------------------------------------------ data
    def examples(self, split: str) -> list[Example]:
        """The generated split (data spec 'task:train' / 'task:valid' / 'task:heldout'), made once per process:
        each split without the problems of the splits after it in heldout, valid, train."""
        if split not in SPLITS:
            raise DataError(f"data spec 'task:{split}': {self.name} makes the splits {', '.join(SPLITS)}")
        if split == "valid" and "valid" not in self.sizes:
            raise DataError(f"data spec 'task:valid': {self.name} makes a validation split with task.args.valid_size")
        if split not in self._splits:
            taken: set = set()
            self.overlap_dropped = 0
            for name in ("heldout", "valid", "train"):
                if name in self.sizes:
                    made = self._generate(name)
                    self._splits[name] = [ex for ex in made if self.problem_key(ex) not in taken]
                    self.overlap_dropped += len(made) - len(self._splits[name])
                    taken |= {self.problem_key(ex) for ex in self._splits[name]}
                if name == split:
                    break
        return list(self._splits[split])

    def _generate(self, split: str) -> list[Example]:
        ds = self._datasets[split]
        return [self._example(ds[i], f"{self.name}@{split}:row {i}") for i in range(len(ds))]

    def _example(self, entry: dict, where: str) -> Example:
        answer = entry["answer"]
        reference = "" if answer is None else str(answer)  # a few datasets have no one answer (their verifier decides)
        solution = f"<answer>{reference}</answer>" if self.answer_format == "tag" and reference else reference
        question = entry["question"] + (f"\n{TAG_INSTRUCTION}" if self.answer_format == "tag" else "")
        return Example(question, reference, solution, where, {"entry": entry})

    def parse(self, record: dict, where: str) -> Example:
        """A reasoning-gym entry saved to a file ({question, answer, metadata}: what its datasets yield)."""
        if not isinstance(record.get("question"), str) or not isinstance(record.get("metadata"), dict):
            raise DataError(
                f"{where}: a {FAMILY} record is a dataset entry {{question, answer, metadata}}; for the generated "
                "problems set data.train: task:train and data.eval: task:heldout"
            )
        entry = {"question": record["question"], "answer": record.get("answer"), "metadata": record["metadata"]}
        return self._example(entry, where)

    # --------------------------------------------------------------------------------------------- grading
    def answer(self, completion: str) -> str | None:
        """The answer a completion commits to: the last <answer>...</answer> (tag), or all of it (plain)."""
        if self.answer_format == "plain":
            return completion.strip() or None
        # reasoning_gym.utils.extract_answer's pairs in one pass: its regex rescans the rest of the text from every
        # unclosed <answer> (0.5 s on 20,000 characters of them, quadratic)
        return last_tagged(completion, "answer")

    def reward(self, completion: str, example: Example) -> float:
        return float(self._datasets["train"].score_answer(self.answer(completion), example.meta["entry"]))

    def has_answer(self, completion: str) -> bool:
        return self.answer(completion) is not None

    def answer_classes(self, completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
        return exact_answer_classes([self.answer(c) or "" for c in completions], timeout_s)


def reasoning_gym_task(dataset: str | None, args: dict) -> ReasoningGymTask:
    """The task `reasoning-gym/<dataset>` (its settings in args) or `reasoning-gym` (args.datasets)."""
    args = dict(args)
    if dataset is None:
        if "datasets" not in args:
            raise ValueError("name the datasets: task.args.datasets: {spell_backward: {weight: 1}, ...}")
        return ReasoningGymTask(composite=True, **args)
    check_dataset(dataset)
    split_keys = ("size", "seed", "heldout_size", "heldout_seed", "valid_size", "valid_seed", "answer_format")
    own = {k: args.pop(k) for k in split_keys if k in args}
    return ReasoningGymTask({dataset: args}, **own)
