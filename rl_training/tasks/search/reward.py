"""Search-R1's answer grading as pure functions (verl/utils/reward_score/qa_em.py), on the sampled text only.

Contract with the episode engine: the text graded is what the policy sampled, the turns joined in order,
never the prompt nor the observations. So neither the prompt's example ('<answer> Beijing </answer>') nor a
retrieved passage that happens to contain '<answer>' can score. That is why one `<answer>` suffices here,
where Search-R1's `extract_solution` grades the prompt + response string and needs at least two (the first
is the prompt's example).

- `normalize_answer`: lowercase, punctuation removed, articles (a, an, the) removed, whitespace collapsed:
  Search-R1's (itself SQuAD's) normalisation, in the same order.
- `last_answer`: the content of the last complete <answer>...</answer>, stripped; None without one.
- `exact_match` / `substring_match`: against any golden answer, after normalisation (em_check, subem_check).
- `search_reward`: compute_score_em's values: 0 without an answer, 1 for a match, `format_score` (default 0,
  Search-R1's) for an answer that does not match: the optional small format credit.
"""

from __future__ import annotations

import re
import string

from rl_training.data.text import last_tagged

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def last_answer(sampled_text: str) -> str | None:
    """The last <answer>...</answer>'s content, stripped (data/text.py last_tagged: one linear pass)."""
    return last_tagged(sampled_text, "answer")


def exact_match(pred: str, golden: list[str]) -> bool:
    p = normalize_answer(pred)
    return any(normalize_answer(g) == p for g in golden)


def substring_match(pred: str, golden: list[str]) -> bool:
    p = normalize_answer(pred)
    return any(normalize_answer(g) in p for g in golden)


def search_reward(sampled_text: str, golden: list[str], match: str = "em", format_score: float = 0.0) -> float:
    pred = last_answer(sampled_text)
    if pred is None:
        return 0.0
    hit = exact_match(pred, golden) if match == "em" else substring_match(pred, golden)
    return 1.0 if hit else format_score
