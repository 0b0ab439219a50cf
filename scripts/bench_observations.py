"""What a text observation costs to encode (rl_training/data/text.py): the worst cases a policy or a tool can send.

    taskset -c 0 .venv/bin/python scripts/bench_observations.py [--budget 4096 --runs 7]

Each row is one observation of `--budget` tokens' worth or more, encoded as the episode engine encodes a text
observation (`encode_observation`: plain text, cut to the budget) with two tokenizers: the tiny byte-level chat
tokenizer (one token a byte) and one with Qwen2.5-Instruct's 22 added tokens and chat template (tests/hostile.py),
where <tool_call> is a non-special added token the tokenizer matches even in plain text. Shapes: plain text;
runs of one look-alike (<tool_call>, matched and split; <|im_end|>, special, never matched); a mix of all 22 of
Qwen2.5's added tokens' strings; the same look-alikes as 10 MiB of text (only a prefix is read). Reported: min,
median and max milliseconds over --runs runs (one process, one thread: run it pinned to a core), the ids
produced, and whether any added token's id slipped through (it must not). Prints a table; JSON to --out.
The goal (issue 38): the worst 4,096-token observation of look-alikes under 50 ms on one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/hostile.py: the Qwen2.5 tokenizer the unit tests use


def shapes(budget: int) -> dict[str, str]:
    from tests.hostile import QWEN25_ADDED

    every = "".join(t for t, _ in QWEN25_ADDED)
    n = budget  # at least one token a character: `budget` characters' worth of each pattern is enough
    return {
        "plain text": ("the quick brown fox jumps over the lazy dog " * n)[: n * 4],
        "<tool_call> run": "<tool_call>" * (n // 4),
        "<|im_end|> run": "<|im_end|>" * (n // 4),
        "all 22 added, mixed": (every * n)[: n * 4],
        "<tool_call> x 10 MiB": "<tool_call>" * ((10 << 20) // 11),
    }


def measure(tokenizer, text: str, budget: int, runs: int) -> dict:
    from rl_training.data.text import encode_observation

    added = set(tokenizer.added_tokens_encoder.values())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        ids, cut = encode_observation(tokenizer, text, budget)
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "min_ms": min(times),
        "median_ms": statistics.median(times),
        "max_ms": max(times),
        "ids": len(ids),
        "cut": cut,
        "added_ids_in_output": len(added.intersection(ids)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "observations.json"))
    a = ap.parse_args(argv)
    from rl_training.policy.tiny_model import build_tokenizer
    from rl_training.runtime.seeding import set_cpu_threads
    from tests.hostile import qwen25_tokenizer

    set_cpu_threads()
    tokenizers = {"tiny byte-level chat": build_tokenizer(chat=True), "Qwen2.5 added tokens": qwen25_tokenizer()}
    rows = []
    for tname, tok in tokenizers.items():
        for sname, text in shapes(a.budget).items():
            row = measure(tok, text, a.budget, a.runs)
            rows.append({"tokenizer": tname, "shape": sname, "chars": len(text), **row})
    print(f"encode_observation, budget {a.budget} tokens, {a.runs} runs (ms)")
    print(f"{'tokenizer':<22} {'shape':<22} {'chars':>9} {'min':>7} {'median':>7} {'max':>7} {'ids':>6} {'added':>5}")
    for r in rows:
        print(
            f"{r['tokenizer']:<22} {r['shape']:<22} {r['chars']:>9} {r['min_ms']:>7.1f} {r['median_ms']:>7.1f} "
            f"{r['max_ms']:>7.1f} {r['ids']:>6} {r['added_ids_in_output']:>5}"
        )
    worst = max(r["median_ms"] for r in rows)
    print(f"worst median: {worst:.1f} ms (goal < 50 ms on one core)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"budget": a.budget, "runs": a.runs, "rows": rows}, indent=1))
    return 0 if all(r["added_ids_in_output"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
