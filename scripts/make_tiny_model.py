"""Create the tiny Qwen2-architecture model + byte-level tokenizer locally (fixed seed, no downloads).

python scripts/make_tiny_model.py --out models/tiny-qwen2 [--seed 0]
python scripts/make_tiny_model.py --out models/tiny-qwen2-chat --chat   # + <|im_start|>/<|im_end|> and a tool template
"""

import argparse

from rl_training.policy.tiny_model import make_tiny_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/tiny-qwen2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="the chat variant with a tool-calling template (docs/tools.md)")
    a = ap.parse_args()
    print(make_tiny_model(a.out, seed=a.seed, chat=a.chat))
