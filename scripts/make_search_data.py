"""Write the synthetic search task (rl_training/tasks/search/synthetic.py): corpus.jsonl, train.jsonl, heldout.jsonl
(disjoint keys) and gold episodes gold_train.jsonl / gold_heldout.jsonl.

python scripts/make_search_data.py --out data/search1                   # 1 hop: one search per question
python scripts/make_search_data.py --out data/search2 --hops 2          # 2 hops: two searches
    [--n-train-keys 20000 --n-heldout-keys 100 --topk 3 --seed 0 --template '{question}\\n' --search-frac 0.3]
"""

import argparse

from rl_training.tasks.search.synthetic import TEMPLATE, write_search_data

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/search1")
    ap.add_argument("--hops", type=int, choices=[1, 2], default=1)
    ap.add_argument("--n-train-keys", type=int, default=20000)
    ap.add_argument("--n-heldout-keys", type=int, default=100)
    ap.add_argument("--n-valid-keys", type=int, default=0, help="also valid.jsonl (a skill gate's check) of so many")
    ap.add_argument("--topk", type=int, default=3, help="passages per search in the gold episodes (= search.topk)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--template", default=TEMPLATE, help="prompt of the gold episodes (= data.prompt_template)")
    ap.add_argument("--search-frac", type=float, help="also write gold_train_mix.jsonl: this share searches")
    ap.add_argument("--syllables", type=int, default=3, help="consonant-vowel pairs per key (3: 'bazoki')")
    a = ap.parse_args()
    kw = {"n_train_keys": a.n_train_keys, "n_heldout_keys": a.n_heldout_keys, "hops": a.hops, "topk": a.topk}
    kw |= {"search_frac": a.search_frac, "syllables": a.syllables, "n_valid_keys": a.n_valid_keys}
    print(write_search_data(a.out, **kw, seed=a.seed, template=a.template.encode().decode("unicode_escape")))
