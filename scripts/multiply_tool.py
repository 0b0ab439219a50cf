"""The tool demo's environment (scripts/demo_tools.py), written the way a researcher writes one (docs/tools.md):
one file, pointed at with `task.name=scripts/multiply_tool.py:MultiplyWithTool`. The question asks for the
product of a 3-digit and a 2-digit number, given as the tool's arguments would be (`Multiply {"a": 347, "b":
58}`); the tiny model cannot multiply, so the one way to score is to call `multiply` through the chat template
and copy its result (`product: 20126`). Records: {"a": 347, "b": 58}; reward 1 when the last number after the
last tool call is the product.

The formats are chosen so that a 1M-parameter model learns to copy within a few hundred SFT steps: every number
it must copy follows the same text at its source and at its copy (`"a": `, `product: `), the pattern induction
heads copy by.

As a script it writes the demo's data (for the tiny chat template, scripts/make_tiny_model.py --chat):

    python scripts/multiply_tool.py --out data/multiply [--tool-frac 0.25]

train.jsonl and heldout.jsonl (held-out first factors never occur in training), valid.jsonl (more products with
held-out first factors: what the warm start's skill gate checks, never the reported held-out set),
gold_train.jsonl (every episode calls the tool, then answers with its result) and gold_train_mix.jsonl (only
--tool-frac of the episodes call it; the others answer at once with a rounded guess: the start that seldom calls
the tool).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from rl_training.tasks import DataError, Example
from rl_training.tasks.tools import ToolEnvironment, final_text


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return f"product: {a * b}"


class MultiplyWithTool(ToolEnvironment):
    tools = (multiply,)
    reward_range = (0.0, 1.0)

    def parse(self, record: dict, where: str) -> Example:
        a, b = record.get("a"), record.get("b")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
            raise DataError(f"{where}: keys 'a' and 'b' must be integers, got {a!r}, {b!r}")
        return Example(json.dumps({"a": a, "b": b}), str(a * b))

    def reward(self, completion: str, example: Example) -> float:
        """1 when the answer's last number is the product."""
        return float(re.findall(r"\d+", final_text(completion))[-1:] == [example.reference])


# The tiny chat template's turns (rl_training/policy/tiny_model.py): a call, the tool turn that answers it.
CALL = '<tool_call>{{"name": "multiply", "arguments": {{"a": {}, "b": {}}}}}</tool_call><|im_end|>'
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def gold_episode(a: int, b: int, call: bool) -> dict:
    """A calling episode (the tool turn masked out of the loss), or a direct answer: a guess rounded to two
    significant figures, right only by accident."""
    if call:
        segments = [
            {"text": CALL.format(a, b), "trainable": True},
            {"text": TOOL_TURN.format(multiply(a, b)), "trainable": False},
            {"text": f"product: {a * b}<|im_end|>", "trainable": True},
        ]
    else:
        guess = int(float(f"{a * b:.2g}"))
        segments = [{"text": f"product: {guess if guess != a * b else guess + 100}<|im_end|>", "trainable": True}]
    return {"question": json.dumps({"a": a, "b": b}), "segments": segments}


def write_data(
    out: Path, tool_frac: float, seed: int = 0, train: int = 2000, heldout: int = 200, valid_n: int = 64
) -> None:
    rng = random.Random(seed)
    firsts = list(range(101, 1000))
    rng.shuffle(firsts)
    held_firsts, train_firsts = firsts[:150], firsts[150:]

    def pairs(pool: list[int], n: int) -> list[tuple[int, int]]:
        return [(rng.choice(pool), rng.choice([b for b in range(12, 100) if b % 10])) for _ in range(n)]

    rows = {"train": pairs(train_firsts, train), "heldout": pairs(held_firsts, heldout)}
    out.mkdir(parents=True, exist_ok=True)
    for split, ps in rows.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in ps))
    gold = [gold_episode(a, b, True) for a, b in rows["train"]]
    mix = [gold_episode(a, b, rng.random() < tool_frac) for a, b in rows["train"]]
    (out / "gold_train.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gold))
    (out / "gold_train_mix.jsonl").write_text("".join(json.dumps(g) + "\n" for g in mix))
    # drawn last, so the files above are the same with or without it: the warm start's skill gate checks these
    valid = [(a, b) for a, b in pairs(held_firsts, valid_n)]
    (out / "valid.jsonl").write_text("".join(json.dumps({"a": a, "b": b}) + "\n" for a, b in valid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/multiply")
    ap.add_argument("--tool-frac", type=float, default=0.25, help="share of gold_train_mix.jsonl that calls")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_data(Path(a.out), a.tool_frac, a.seed)
    print(f"wrote {a.out}/{{train,heldout,valid,gold_train,gold_train_mix}}.jsonl")


if __name__ == "__main__":
    main()
