"""A synthetic program-synthesis task the tiny model can learn on CPU, in the `humaneval` format.

The prompt shows a function `f(x)` of a short lowercase string only through two input/output examples (each
shown input starts with the letter `MARK` and has it nowhere else, so where it lands shows reversal) and
ends at `return `; the completion is an expression in `x`, one of 12: reversed or not, uppercased or not,
with a 'z' added after, before or not at all, e.g. `'z' + x[::-1].upper()`. The tests call the function on
four other strings, so a pass means the expression behaves right on inputs the prompt did not show (an
answer that hard-codes the examples fails); they run in the sandbox like any code task. Train and held-out
splits are disjoint sets of prompts drawn from a fixed seed.

    python scripts/make_code_data.py --out data/code_synth
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# The expression is one choice per feature: how visible a feature is in the examples sets how fast the model
# learns it. Uppercase and the 'z' affix show at a glance; reversal with random shown inputs shows only by
# comparing letters' positions, which the tiny model did not learn (200 SFT steps: every feature right but
# reversal, at chance; 40 RL steps from there: no change), hence the marker below (100 SFT steps: all right).
FEATURES = (("", "[::-1]"), ("", ".upper()"), ("{} + 'z'", "'z' + {}", "{}"))
PROGRAMS = tuple(affix.format(f"x{rev}{case}") for rev in FEATURES[0] for case in FEATURES[1] for affix in FEATURES[2])
INPUT_LETTERS = "abcdefghijklmnop"
# A shown input starts with this letter and has it nowhere else, so reversal is visible at a glance: the
# marker ends up first or last in the output (after or before a 'z', 'A' when uppercased). Hidden inputs
# are drawn from all of INPUT_LETTERS, so a pass still needs a real reversal.
MARK = "a"


def _word(rng: random.Random, first: str = "", letters: str = INPUT_LETTERS) -> str:
    return first + "".join(rng.choice(letters) for _ in range(rng.randint(4, 6) - len(first)))


def _apply(expr: str, x: str) -> str:
    return eval(expr, {"__builtins__": {}}, {"x": x})


def make_problem(rng: random.Random, expr: str, index: int) -> dict:
    shown = [_word(rng, MARK, INPUT_LETTERS.replace(MARK, "")) for _ in range(2)]
    hidden = [_word(rng) for _ in range(4)]
    lines = "".join(f"    # f({w!r}) == {_apply(expr, w)!r}\n" for w in shown)
    test = "def check(candidate):\n" + "".join(f"    assert candidate({w!r}) == {_apply(expr, w)!r}\n" for w in hidden)
    prompt = f"def f(x):\n{lines}    return "
    return {"task_id": f"synth/{index}", "prompt": prompt, "entry_point": "f", "test": test,
            "canonical_solution": f"{expr}\n"}  # fmt: skip


def make_code_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < n_train + n_heldout:
        p = make_problem(rng, rng.choice(PROGRAMS), len(out))
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            out.append(p)
    return out[:n_train], out[n_train:]


def write_code_data(out: str | Path, n_train: int = 4000, n_heldout: int = 256, seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, recs in zip(("train", "heldout"), make_code_splits(n_train, n_heldout, seed), strict=True):
        tmp = out / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(out / f"{name}.jsonl")
    return out
