"""pass@k, maj@k and the summary over per-problem records (rl_training/evaluation/pass_at_k.py): hand values
and brute-force enumeration of every subset."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.evaluation.pass_at_k import maj_at_k, pass_at_k, summarize
from tests.helpers import maj_by_enumeration, pass_by_enumeration


# ------------------------------------------------------------------------------------------------ pass@k
@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 1, 0.25),  # pass@1 = c/n
        (10, 3, 1, 0.3),
        (8, 1, 4, 0.5),  # 1 - C(7,4)/C(8,4) = 1 - 35/70
        (10, 0, 5, 0.0),  # nothing correct
        (10, 10, 1, 1.0),
        (6, 4, 3, 1.0),  # n - c = 2 < k = 3: every 3-subset holds a correct sample
        (20, 1, 20, 1.0),
    ],
)
def test_pass_at_k_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_enumeration_of_all_subsets():
    for n in range(1, 11):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(pass_by_enumeration(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows float64; the product form does not. Exact value with rationals:
    n, c, k = 1000, 3, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)  # = 1 - (1/2)(499/999)(498/998) ~ 0.875


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------------- maj@k
@pytest.mark.parametrize(
    "classes, correct, k, expected",
    [
        # Subsets of size 2 of {A1, A2, B}: {A,A} -> A right; {A1,B}, {A2,B} tie -> 1/2 each: (1 + .5 + .5) / 3
        (["A", "A", "B"], [True, True, False], 2, 2 / 3),
        (["A", "A", "B"], [True, True, False], 3, 1.0),  # A has 2 of 3 votes
        (["A", "A", "B"], [True, True, False], 1, 2 / 3),  # maj@1 = pass@1
        # {A,-}: A wrong -> 0; {A,B}: tie -> 1/2; {-,B}: B right -> 1: (0 + .5 + 1) / 3
        (["A", None, "B"], [False, False, True], 2, 0.5),
        ([None, None], [False, False], 1, 0.0),  # nobody votes: wrong
        # 4 samples, the correct class B has 1 vote, A has 3: only subsets without 2+ A's let B win.
        # k=2: {A,A} x3 -> 0, {A,B} x3 -> tie 1/2: 1.5 / 6
        (["A", "A", "A", "B"], [False, False, False, True], 2, 0.25),
    ],
)
def test_maj_at_k_values(classes, correct, k, expected):
    assert maj_at_k(classes, correct, k) == pytest.approx(expected, abs=1e-12)


def test_maj_at_k_matches_enumeration_of_all_subsets():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 10)
        classes = [rng.choice([0, 1, 2, 3, None]) for _ in range(n)]
        if rng.random() < 0.5:  # a consistent grader: a class is right or wrong as a whole
            right = {c: rng.random() < 0.4 for c in range(4)}
            correct = [c is not None and right[c] for c in classes]
        else:  # members of one class graded differently: the class counts in proportion
            correct = [c is not None and rng.random() < 0.5 for c in classes]
        for k in range(1, n + 1):
            assert maj_at_k(classes, correct, k) == pytest.approx(maj_by_enumeration(classes, correct, k), abs=1e-12), (
                classes,
                correct,
                k,
            )


def test_maj_at_k_large_n_is_fast_and_exact_on_a_known_case():
    # 64 distinct answers, one right: a k-subset containing it (prob k/64) is a k-way tie won with 1/k.
    classes, correct = list(range(64)), [True] + [False] * 63
    assert maj_at_k(classes, correct, 8) == pytest.approx(1 / 64)


def record(greedy_correct, sample_correct, classes=None, reward=None):
    classes = classes or list(range(len(sample_correct)))
    g = {"text": "", "reward": reward if reward is not None else float(greedy_correct), "correct": greedy_correct}
    g.update(formatted=True, length=4, truncated=False)
    samples = [
        {"text": "", "reward": float(c), "correct": c, "formatted": c, "length": 2 + i, "truncated": i == 0}
        | {"answer_class": cl}
        for i, (c, cl) in enumerate(zip(sample_correct, classes, strict=True))
    ]
    return {"greedy": g, "samples": samples}


def test_summarize_values():
    problems = [
        record(True, [True, False, False, False], classes=[0, 1, 1, 2]),
        record(False, [False, False, False, False], reward=0.5),
    ]
    m = summarize(problems, ks=[1, 2])
    assert m["accuracy"] == 0.5 and m["reward_mean"] == 0.75  # (1 + 0.5) / 2
    assert m["pass@1"] == pytest.approx((1 / 4 + 0) / 2)
    assert m["pass@2"] == pytest.approx((1 - math.comb(3, 2) / math.comb(4, 2)) / 2)  # (1 - 3/6) / 2
    # problem 1, k=2: the right class 0 ties in {0,1},{0,1},{0,2} -> 3 x 1/2 of 6 subsets = 1/4
    assert m["maj@2"] == pytest.approx(0.25 / 2)
    assert m["sampled_format_rate"] == pytest.approx(1 / 8) and m["sampled_truncation_rate"] == 0.25
    assert m["sampled_response_len_mean"] == pytest.approx(3.5)  # lengths 2, 3, 4, 5
    assert set(summarize([record(True, [])], ks=[])) == {
        "accuracy",
        "reward_mean",
        "format_rate",
        "response_len_mean",
        "truncation_rate",
    }


def test_summarize_multi_turn_records_means_their_counts_and_rates_their_env_errors():
    """Two episodes (evaluate.py's records: turns and counts beside the completion keys, and the engine's
    `error`): turns (2 + 3) / 2, tool calls (1 + 0) / 2; one of the two ended by its environment."""
    a, b = record(True, []), record(False, [])
    a["greedy"] |= {"turns": 2, "tool_calls": 1, "error": ""}
    b["greedy"] |= {"turns": 3, "tool_calls": 0, "error": "env_error: Env.step raised ValueError: x"}
    m = summarize([a, b], ks=[])
    assert (m["turns_mean"], m["tool_calls_mean"], m["env_error_rate"]) == (2.5, 0.5, 0.5)
    assert "error_mean" not in m


def test_eval_config_checks_k_against_samples():
    with pytest.raises(ConfigError, match=r"eval.ks=\[1, 16\]: k=16 is outside 1..eval.num_samples=8"):
        load_config(None, ["eval.ks=[1,16]"])
    with pytest.raises(ConfigError, match="k=0"):
        load_config(None, ["eval.ks=[0]"])
    assert load_config(None, ["eval.num_samples=0", "eval.ks=[]"]).eval.ks == []
