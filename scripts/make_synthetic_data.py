"""Write the synthetic string-reversal task: train.jsonl and a disjoint heldout.jsonl.

python scripts/make_synthetic_data.py --out data/reverse [--n-train 4000 --n-heldout 256 --seed 0]
"""

import argparse

from rl_training.tasks.reverse import write_reverse_data

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="data/reverse")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-heldout", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_reverse_data(a.out, a.n_train, a.n_heldout, a.seed))
