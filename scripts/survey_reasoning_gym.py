"""Which reasoning-gym datasets the tiny CPU model learns within a few minutes (the table in docs/extending.md).

    .venv/bin/python scripts/survey_reasoning_gym.py [--only spell_backward,letter_counting] [--output-dir DIR]
    nice -n 5 taskset -c 1 env RL_CPU_THREADS=1 .venv/bin/python scripts/survey_reasoning_gym.py   # on one core

For each candidate (a dataset with small settings, answers in plain text): the reasoning-gym demo's protocol
(scripts/demo_reasoning_gym.py, cfg/spell_sft.yaml and cfg/spell_cpu.yaml with the dataset swapped in): SFT of all
weights of the random tiny model on the train split's answers, then Dr-GRPO + LoRA from it, and the held-out greedy
reward and accuracy (128 problems never trained on) before and after RL. `const` is the accuracy of answering every
held-out problem with the split's most common answer, what a model that ignores the question reaches. Learned: yes
when the held-out greedy accuracy after RL is at least 0.5 above `const`, partly when at least 0.2 above it
(LEARNED), else no. Prints a markdown table and writes DIR/survey.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo_reasoning_gym import RL_CFG, SFT_CFG, SPLITS, sft_then_rl, task_overrides  # noqa: E402

LEARNED = ((0.5, "yes"), (0.2, "partly"))  # (accuracy above const, verdict), the first that holds

# (dataset, its settings, new tokens: the longest answer + EOS, with a little room)
CANDIDATES = [
    ("spell_backward", {"min_word_len": 3, "max_word_len": 5}, 8),
    ("letter_counting", {"min_words": 3, "max_words": 5}, 4),
    ("number_sequence", {"min_terms": 4, "max_terms": 5, "max_complexity": 1}, 6),
    (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 2,
            "operators": ["+"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
        5,
    ),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 5),
    ("count_bits", {"min_n": 1, "max_n": 1000}, 4),
    ("gcd", {"min_value": 1, "max_value": 50}, 4),
]


def most_common_share(dataset: str, settings: dict) -> float:
    from rl_training.tasks.build import make_task

    task = make_task(f"reasoning-gym/{dataset}", {**settings, **SPLITS})
    held = task.examples("heldout")
    return Counter(ex.reference for ex in held).most_common(1)[0][1] / len(held)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated dataset names (default: every candidate)")
    ap.add_argument("--output-dir", default="runs/survey_reasoning_gym")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dataset, settings, new_tokens in CANDIDATES:
        if only and dataset not in only:
            continue
        t0 = time.time()
        over = task_overrides(dataset, settings, new_tokens)
        r = sft_then_rl(f"survey_{dataset}", over, str(out))
        minutes = (time.time() - t0) / 60
        const = most_common_share(dataset, settings)
        acc = r["after"]["greedy_accuracy"]
        learned = next((word for margin, word in LEARNED if acc - const >= margin), "no")
        row = {"dataset": dataset, "settings": settings, "const": const, "learned": learned, "minutes": minutes}
        rows.append(row | {k: r[k] for k in ("before", "after", "times")})
        print(f"survey: {dataset}: {json.dumps(rows[-1], default=str)[:400]}", flush=True)
        (out / "survey.json").write_text(json.dumps(rows, indent=2, default=str))
    print("\n| dataset | settings | const | SFT start: reward / acc | after RL: reward / acc | learned | minutes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b, f = r["before"], r["after"]
        s = ", ".join(f"{k} {v}" for k, v in r["settings"].items())
        print(
            f"| {r['dataset']} | {s} | {r['const']:.2f} | {b['greedy_reward']:.2f} / {b['greedy_accuracy']:.2f} | "
            f"{f['greedy_reward']:.2f} / {f['greedy_accuracy']:.2f} | {r['learned']} | "
            f"{r['minutes']:.1f} |"
        )
    print(f"\n{out / 'survey.json'}; protocol: {SFT_CFG} then {RL_CFG} with the dataset swapped in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
