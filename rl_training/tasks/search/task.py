"""Search-R1 as an Environment: records, the episode protocol, the retriever it owns, and its grading.

An episode: the policy writes `<search>query</search>` (the turn stops there) and gets Search-R1's
`<information>...</information>` block of the top search.topk passages, or `<answer>...</answer>`, which ends it.
A turn with neither gets Search-R1's invalid-action text. One batched `retrieve` serves every episode that
searched in a turn. Where it departs from Search-R1 (search_r1/llm_agent/generation.py):
- An episode that samples EOS ends there (Search-R1 keeps generating after an EOS turn until max_turns).
- A turn cut by the episode's token budget without an action is a truncation, not an invalid action.

Records: Search-R1's rows as their scripts/data_process/*.py write them (question, reward_model.ground_truth.target
= the golden answers, data_source) or plain jsonl {"question", "golden_answers": [...]} (or a single "answer");
the row's `prompt` column is not read: the prompt comes from data.prompt_template, so one template serves every
source (docs/search.md). Grading: exact (or substring) match of the last <answer> of the sampled text against
any golden answer (reward.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from rl_training.data.sources import DataError, Example
from rl_training.retrieval.retriever import RetrievalStats, Retriever, information_block
from rl_training.tasks.base import Environment, Scores, Step, TaskContext, Turn
from rl_training.tasks.search.reward import exact_match, last_answer, normalize_answer, search_reward, substring_match

# Search-R1's text after a turn that neither searched nor answered (generation.py, execute_predictions).
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let's try again.\n"
)
_OPENING = re.compile(r"<(search|answer)>")
SEARCH_PARTS = ("em", "subem", "answered")  # per episode: exact match, substring match, has an <answer>


def parse_action(text: str) -> tuple[str, str]:
    """('search', query) | ('answer', answer) | ('invalid', '') from one turn's sampled text: its first
    complete tag pair, as Search-R1's postprocess_predictions (a turn stops at its first closing tag)."""
    # What re.search(r"<(search|answer)>(.*?)</\1>", text, re.S) finds (the first opening that some later tag of
    # its kind closes), without rescanning the rest of the text from every unclosed opening (2 s on 6,000).
    last_close = {kind: text.rfind(f"</{kind}>") for kind in ("search", "answer")}
    for m in _OPENING.finditer(text):
        kind = m.group(1)
        if last_close[kind] >= m.end():
            return kind, text[m.end() : text.find(f"</{kind}>", m.end())].strip()
    return "invalid", ""


def _golden_answers(rec: dict, where: str, answer_key: str) -> list[str]:
    gt = rec.get("reward_model")
    if isinstance(gt, dict) and isinstance(gt.get("ground_truth"), dict) and "target" in gt["ground_truth"]:
        golden, key = gt["ground_truth"]["target"], "reward_model.ground_truth.target"
    elif "golden_answers" in rec:
        golden, key = rec["golden_answers"], "golden_answers"
    elif answer_key in rec:
        golden, key = [rec[answer_key]], answer_key
    else:
        raise DataError(
            f"{where}: no golden answers (reward_model.ground_truth.target, golden_answers or {answer_key})"
        )
    if isinstance(golden, str | int | float):
        golden = [golden]
    if not isinstance(golden, list) or not golden or not all(isinstance(g, str | int | float) for g in golden):
        raise DataError(f"{where}: key '{key}' must be a non-empty list of strings, got {golden!r:.80}")
    return [str(g) for g in golden]


def search_example(rec: dict, where: str, question_key: str = "question", answer_key: str = "answer") -> Example:
    """A Search-R1 row (or its plain jsonl form) as an Example: the question as is (Search-R1's data scripts
    already added the '?'), reference = the first golden answer, meta = {"golden_answers": all of them,
    "data_source": ...}."""
    q = rec.get(question_key)
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{where}: key '{question_key}' must be a non-empty string (has: {', '.join(map(str, rec))})")
    golden = _golden_answers(rec, where, answer_key)
    meta = {"golden_answers": golden, "data_source": str(rec.get("data_source", ""))}
    return Example(q.strip(), golden[0], golden[0], where, meta)


def search_answer_classes(completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
    """Voting classes by the normalised last answer; no answer = None."""
    ids: dict[str, int] = {}
    answers = [last_answer(c) for c in completions]
    return [None if a is None else ids.setdefault(normalize_answer(a), len(ids)) for a in answers]


class SearchTask(Environment):
    """search (exact match) / search_subem (substring match); the retriever is built from search.* at start."""

    stop = ("</search>", "</answer>")
    episode_counts = ("searches", "invalid", "answered")
    part_names = SEARCH_PARTS

    def __init__(
        self,
        search_cfg,
        match: Literal["em", "subem"] = "em",
        format_score: float = 0.0,
        question_key: str = "question",
        answer_key: str = "answer",
    ):
        if match not in ("em", "subem"):
            raise ValueError(f"SearchTask match must be em or subem, got {match!r}")
        self.search_cfg, self.match, self.format_score = search_cfg, match, format_score
        self.reward_range = (min(0.0, format_score), max(1.0, format_score))  # search_reward: 0, format_score or 1
        self.question_key, self.answer_key = question_key, answer_key
        self.topk = search_cfg.topk
        self.retriever: Retriever | None = None

    def start(self, ctx: TaskContext | None = None) -> None:
        from rl_training.retrieval.build import make_retriever

        if self.retriever is None:
            self.retriever = make_retriever(self.search_cfg)

    def close(self) -> None:
        if self.retriever is not None:
            self.retriever.close()
            self.retriever = None

    # ------------------------------------------------------------------------------------------- records
    def parse(self, record: dict, where: str) -> Example:
        return search_example(record, where, self.question_key, self.answer_key)

    def problem_key(self, example: Example):
        return example.question  # nothing hidden: the question decides the golden answers

    # ------------------------------------------------------------------------------------------- grading
    def reward(self, completion: str, example: Example) -> float:
        return search_reward(completion, _golden(example), self.match, self.format_score)

    def has_answer(self, completion: str) -> bool:
        return last_answer(completion) is not None

    def grade(self, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
        """Each completion (the episode's sampled text only, see reward.py) against all of its example's
        golden answers (the reference alone when there are none)."""
        parts: dict[str, list[float]] = {k: [] for k in SEARCH_PARTS}
        rewards = []
        for c, ex in zip(completions, examples, strict=True):
            golden = _golden(ex)
            rewards.append(search_reward(c, golden, self.match, self.format_score))
            pred = last_answer(c)
            parts["answered"].append(float(pred is not None))
            parts["em"].append(float(pred is not None and exact_match(pred, golden)))
            parts["subem"].append(float(pred is not None and substring_match(pred, golden)))
        correct = [x == 1.0 for x in parts[self.match]]
        return Scores(rewards, correct, [x == 1.0 for x in parts["answered"]], parts=parts)

    def answer_classes(self, completions: Sequence[str], timeout_s: float = 5.0) -> list[int | None]:
        return search_answer_classes(completions, timeout_s)

    # ------------------------------------------------------------------------------------------ episodes
    def call_stats(self) -> RetrievalStats:
        return RetrievalStats()

    def step_batch(self, states: list, turns: list[Turn], stats: RetrievalStats) -> list[Step]:
        steps: list[Step | None] = []
        searched: list[tuple[int, str]] = []  # (index into steps, query)
        for t in turns:
            kind, arg = parse_action(t.text)
            if kind == "answer":
                steps.append(Step(done=True, counts={"answered": 1}))
            elif t.eos:
                steps.append(Step(done=True))  # EOS ends the episode (module docstring)
            elif kind == "search":
                searched.append((len(steps), arg))
                steps.append(None)
            elif t.exhausted:
                steps.append(Step())  # cut by the episode's budget: the engine ends it truncated
            else:
                steps.append(Step(INVALID_ACTION, counts={"invalid": 1}))
        if searched:
            if self.retriever is None:
                raise RuntimeError("SearchTask.step_batch before start(): no retriever")
            result = self.retriever.retrieve([q for _, q in searched], self.topk)
            stats.add(result)
            for k, (i, _) in enumerate(searched):
                steps[i] = Step(information_block(result.passages[k], result.errors[k]), counts={"searches": 1})
        return steps

    def episode_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {
            "rollout/searches_mean": sums["searches"] / n,
            "rollout/valid_action_rate": (sums["turns"] - sums["invalid"]) / max(sums["turns"], 1.0),
            "rollout/answer_rate": sums["answered"] / n,
        }


def _golden(example: Example) -> list[str]:
    return example.meta.get("golden_answers") or [example.reference]
