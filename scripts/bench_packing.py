"""Padded vs padding-free (packed) training update on a length-skewed batch: tokens/s, side by side.

    python scripts/bench_packing.py [--groups 16 --group-size 8 --reps 15] [--row-tokens 0]

One micro-batch of `groups` x `group-size` sequences: prompts of 6-10 tokens, completions mostly 2-8 tokens with
one long one (48-64 tokens) per group, the shape of a batch where a few completions run to the limit. Each
repetition runs the real update (trainer.train_on_rollouts: forward, log-probs, Dr-GRPO loss, backward, SGD
with lr 0) once padded and once packed, alternating, and the script prints the median seconds, the real
(non-pad) tokens per second, the tokens each layout ran the model on, and the largest gradient difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def skewed(groups: int, group_size: int, seed: int = 0):
    import torch

    from rl_training.rollout.base import Rollouts

    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for _ in range(groups):
        p = torch.randint(2, 200, (int(torch.randint(6, 11, (1,), generator=g)),), generator=g).tolist()
        for i in range(group_size):
            lo, hi = (48, 65) if i == 0 else (2, 9)
            n = int(torch.randint(lo, hi, (1,), generator=g))
            prompts.append(p)
            comps.append(torch.randint(2, 200, (n,), generator=g).tolist())
    return Rollouts(prompts, comps, [[-1.0] * len(c) for c in comps], [False] * len(comps), [""] * len(comps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--row-tokens", type=int, default=0)
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from rl_training.algs.objectives import StepNorm
    from rl_training.config.schema import LoraCfg
    from rl_training.policy.models import apply_lora, trainable_parameters
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.train.batches import make_micro_batches
    from rl_training.train.learner import UpdateHParams, train_on_rollouts
    from rl_training.train.packing import padded_tokens

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraCfg(r=8, alpha=16))
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ro = skewed(a.groups, a.group_size)
    adv = torch.randn(len(ro), dtype=torch.float64)
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=64)
    hp = UpdateHParams(max_grad_norm=0.0, log_kl=False)
    G, cpu = a.group_size, torch.device("cpu")

    def run(pack: int | None) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        mbs = make_micro_batches(ro, adv, G, a.groups, 0, cpu, pack_row_tokens=pack)
        train_on_rollouts(model, opt, sched, params, mbs, hp, norm)
        return time.perf_counter() - t0, torch.cat([p.grad.reshape(-1) for p in params])

    layouts = {"padded": None, "packed": a.row_tokens}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    grads = {}
    for v in layouts.values():  # warm-up
        run(v)
    for _ in range(a.reps):
        for k, v in layouts.items():
            dt, grads[k] = run(v)
            times[k].append(dt)
    seqs = [p + c for p, c in zip(ro.prompt_ids, ro.completion_ids, strict=True)]
    real = sum(len(s) for s in seqs)
    pad_tok, pack_tok = padded_tokens(seqs)
    if a.row_tokens:
        pack_tok = make_micro_batches(ro, adv, G, a.groups, 0, cpu, pack_row_tokens=a.row_tokens)[0].packed
        pack_tok = pack_tok.input_ids.numel()
    ran = {"padded": pad_tok, "packed": pack_tok}
    print(f"{len(seqs)} sequences, {real} real tokens, longest {max(map(len, seqs))}; {a.reps} reps, medians")
    print(f"{'layout':<8}{'s/update':>10}{'real tok/s':>12}{'tokens run':>12}")
    for k in layouts:
        med = statistics.median(times[k])
        print(f"{k:<8}{med:>10.4f}{real / med:>12.0f}{ran[k]:>12}")
    speed = statistics.median(times["padded"]) / statistics.median(times["packed"])
    diff = (grads["packed"] - grads["padded"]).abs().max().item()
    print(f"packed speed-up {speed:.2f}x; max |grad packed - padded| = {diff:.2e} (float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
