"""Score a policy on held-out prompts with the training grader and prompt template.

Used by the embedded demo's before/after table (and by the eval pipeline). Greedy decoding by default;
sampled scoring gives the policy's expected reward at the training temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_training.data.prompts import encode_prompts
from rl_training.data.sources import Example
from rl_training.rewards import Task, score_completions
from rl_training.rollout.base import SamplingSpec


@dataclass
class HeldoutResult:
    mean_reward: float
    accuracy: float
    format_rate: float
    mean_length: float
    truncation_rate: float
    n: int
    completions: list[str]


def evaluate(
    backend,
    tokenizer,
    examples: list[Example],
    data_cfg,
    task: Task,
    max_new_tokens: int,
    greedy: bool = True,
    n: int = 1,
    temperature: float = 1.0,
    timeout_s: float = 5.0,
) -> HeldoutResult:
    prompts = encode_prompts(examples, data_cfg, tokenizer)
    spec = SamplingSpec(n=n, max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy)
    ro = backend.generate(prompts, spec)
    refs = [ex.reference for ex in examples for _ in range(n)]
    sc = score_completions(task, ro.texts, refs, timeout_s)
    k = len(ro)
    return HeldoutResult(
        mean_reward=sum(sc.rewards) / k,
        accuracy=sum(sc.correct) / k,
        format_rate=sum(sc.formatted) / k,
        mean_length=sum(len(c) for c in ro.completion_ids) / k,
        truncation_rate=sum(ro.truncated) / k,
        n=k,
        completions=ro.texts,
    )
