"""Prompt rendering (one template for training, SFT and evaluation) and the seeded, rank-sharded sampler."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from rl_training.data.sources import DataError, Example


def chat_template_on(setting: bool | str, tokenizer) -> bool:
    """data.use_chat_template resolved against the tokenizer: 'auto' = whether it has a chat template (an instruct
    model's prompts in its own format); true without a template is an error naming the model."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "auto":
        return has
    if setting and not has:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"data.use_chat_template=true but the tokenizer of {name!r} has no chat template")
    return bool(setting)


def render_prompt(
    question: str, template: str, tokenizer=None, use_chat_template: bool | str = False, system_prompt: str = ""
) -> str:
    """`template` around the question; in the tokenizer's chat template as the user turn (after a system turn
    when `system_prompt`) when `use_chat_template` says so (chat_template_on)."""
    # str.replace, not str.format: LaTeX questions are full of braces.
    text = template.replace("{question}", question)
    if not chat_template_on(use_chat_template, tokenizer):
        return text
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def dedupe_questions(examples: list[Example], key: Callable[[Example], Hashable] | None = None) -> tuple[list, int]:
    """Keep the first example of each problem, in order: its question text, or `key(example)` (a task's
    `problem_key`). A problem drawn twice in one step would make two prompt groups correlated units, which biases
    the GNS (docs/probes.md 2, pitfall P7) and double-weights it."""
    key = key or (lambda ex: ex.question)
    seen: set = set()
    kept = [ex for ex in examples if not ((k := key(ex)) in seen or seen.add(k))]
    return kept, len(examples) - len(kept)


def encode_prompts(examples: list[Example], data_cfg, tokenizer, task) -> list[list[int]]:
    """Token ids of each prompt as `task.render_prompt` renders it; one over data.max_prompt_tokens is an error
    naming it."""
    out = []
    for ex in examples:
        text = task.render_prompt(ex, tokenizer, data_cfg)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) > data_cfg.max_prompt_tokens:
            raise DataError(
                f"{ex.source}: prompt has {len(ids)} tokens > data.max_prompt_tokens={data_cfg.max_prompt_tokens}"
            )
        out.append(ids)
    return out


REFILL_STREAM = 0xD5  # keeps the refill draws' seeds apart from the epoch permutations' [seed, epoch]


@dataclass(frozen=True)
class PromptSampler:
    """Which prompts each rank trains on at each step, and how many completions each gets: a pure function of
    (seed, step, rank) and the schedule.

    Each epoch is a fresh seeded permutation of the dataset; each step takes the next `prompts_per_step`
    indices (the remainder of an epoch is dropped so every step is full) and rank r takes its contiguous
    slice, so ranks see disjoint prompts. Being stateless, the data position after a resume is exact.

    `segments`: ((first step, prompts per step, group size), ...) in increasing step order, where the split
    changes (rollout.group_size_auto, probes/group_size.py); before the first one, (`prompts_per_step`,
    `group_size`). A step of a new split continues the epoch where the last step left it.
    """

    n: int
    prompts_per_step: int
    group_size: int
    world_size: int
    seed: int
    segments: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_config(cls, cfg, n: int, world_size: int, segments=()) -> PromptSampler:
        """The configured split (rollout.prompts_per_step, rollout.group_size) and data order (train.seed)."""
        return cls(n, cfg.rollout.prompts_per_step, cfg.rollout.group_size, world_size, cfg.train.seed, segments)

    def __post_init__(self):
        if self.n < self.prompts_per_step:
            raise DataError(f"dataset has {self.n} prompts < rollout.prompts_per_step={self.prompts_per_step}")
        for start, b, _ in self.segments:
            if self.n < b:
                raise DataError(
                    f"dataset has {self.n} prompts < the {b} prompts per step of the split from step {start}"
                )

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.prompts_per_step

    def split(self, step: int) -> tuple[int, int]:
        """(prompts per step, group size) of 0-based `step`."""
        b, k = self.prompts_per_step, self.group_size
        for start, sb, sk in self.segments:
            if start > step:
                break
            b, k = sb, sk
        return b, k

    def switched(self, step: int, prompts_per_step: int, group_size: int) -> PromptSampler:
        """This sampler with the split (`prompts_per_step`, `group_size`) from `step` on (later segments dropped)."""
        kept = tuple(s for s in self.segments if s[0] < step)
        return dataclasses.replace(self, segments=(*kept, (step, prompts_per_step, group_size)))

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset into that epoch's permutation) at the start of 0-based `step`: each split's steps take
        `b` indices while an epoch has `b` left."""
        epoch, offset, at, b = 0, 0, 0, self.prompts_per_step
        for start, nb, _ in (*self.segments, (step, 0, 0)):
            n = min(start, step) - at  # steps of this split before `start`
            left = (self.n - offset) // b  # of them, how many fit in the current epoch
            if n <= left:
                offset += n * b
            else:  # the other m >= 1 fill fresh epochs of `per` steps, the last holding r in 1..per of them
                m, per = n - left, self.n // b
                q = (m - 1) // per
                epoch, offset = epoch + 1 + q, (m - q * per) * b
            if start >= step:
                break
            at, b = start, nb
        if offset + self.split(step)[0] > self.n:  # the step does not fit in the epoch's remainder: the next one
            epoch, offset = epoch + 1, 0
        return epoch, offset

    def refill_indices(self, step: int, rank: int, round_: int, n: int) -> list[int]:
        """`n` distinct prompts for refill round `round_` (1, 2, ...) of `step` on `rank` (rollout.dynamic_sampling):
        a seeded draw from the whole dataset, a pure function of (seed, step, rank, round), so a resumed run
        refills with the same prompts. The step's own prompts may be drawn again."""
        rng = np.random.default_rng([self.seed, step, rank, round_, REFILL_STREAM])
        return rng.choice(self.n, size=min(n, self.n), replace=False).tolist()

    def indices(self, step: int, rank: int) -> list[int]:
        epoch, offset = self.position(step)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        per_rank = self.split(step)[0] // self.world_size
        start = offset + rank * per_rank
        return perm[start : start + per_rank].tolist()
