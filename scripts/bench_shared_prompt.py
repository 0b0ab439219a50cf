"""Padded rows vs shared-prompt rows (train.share_prompt) for one training update, side by side.

    python scripts/bench_shared_prompt.py [--model models/smollm2-135m-instruct] [--groups 8 --group-size 8]
        [--prompt 68,76 --completion 6,16 --micro 4 --reps 5] [--json out.json]

The batch has the shape of the real-model demo's steps (docs/real_model.md): `groups` prompts of a chat template's
length (token counts drawn in --prompt), each with `group-size` completions of --completion tokens (random token
ids: the cost does not depend on them). Each repetition runs the real update (learner.train_on_rollouts: forward,
log-probs, Dr-GRPO loss, backward, SGD with lr 0) once padded and once shared, alternating, and the script prints
the seconds per update (median [min-max]), the tokens each layout ran the model on, and the largest gradient
difference relative to the largest gradient. The model is --model if it exists (make real-model), else the tiny one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rollouts(groups: int, group_size: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int):
    import torch

    from rl_training.rollout.base import Rollouts

    g = torch.Generator().manual_seed(0)

    def draw(lo_hi: tuple[int, int]) -> list[int]:
        n = int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    prompts, comps = [], []
    for _ in range(groups):
        p = draw(prompt)
        for _ in range(group_size):
            prompts.append(p)
            comps.append(draw(completion))
    return Rollouts(prompts, comps, [[-1.0] * len(c) for c in comps], [False] * len(comps), [""] * len(comps))


def span(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    return lo, hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=span, default=(68, 76), help="prompt tokens, lo,hi")
    ap.add_argument("--completion", type=span, default=(6, 16), help="completion tokens, lo,hi")
    ap.add_argument("--micro", type=int, default=4, help="groups per micro-batch (train.micro_batch_groups)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from rl_training.algs.objectives import StepNorm
    from rl_training.base.groups import Groups
    from rl_training.config.schema import LoraCfg
    from rl_training.policy.models import apply_lora, trainable_parameters
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.train.batches import make_micro_batches
    from rl_training.train.learner import UpdateHParams, train_on_rollouts
    from rl_training.train.shared_prompt import shared_tokens

    torch.manual_seed(0)
    model_dir = Path(a.model)
    if not (model_dir / "config.json").exists():
        model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = apply_lora(base, LoraCfg(r=16, alpha=32))
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ro = rollouts(a.groups, a.group_size, a.prompt, a.completion, base.config.vocab_size)
    adv = torch.randn(len(ro), dtype=torch.float64)
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=a.completion[1])
    hp = UpdateHParams(max_grad_norm=0.0, log_kl=False)
    cpu = torch.device("cpu")

    def run(share: bool) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        mbs = make_micro_batches(ro, adv, a.group_size, a.micro, 0, cpu, share_prompt=share)
        train_on_rollouts(model, opt, sched, params, mbs, hp, norm)
        return time.perf_counter() - t0, torch.cat([p.grad.reshape(-1) for p in params])

    layouts = {"padded": False, "shared": True}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    grads = {}
    for v in layouts.values():  # warm-up
        run(v)
    for _ in range(a.reps):
        for k, v in layouts.items():
            dt, grads[k] = run(v)
            times[k].append(dt)
    padded_n, shared_n = shared_tokens(ro.prompt_ids, ro.completion_ids, Groups.of_rows(len(ro), a.group_size))
    ran = {"padded": padded_n, "shared": shared_n}
    print(
        f"{model_dir.name}: {a.groups} groups x {a.group_size}, prompts {a.prompt[0]}-{a.prompt[1]} tokens, "
        f"completions {a.completion[0]}-{a.completion[1]}, {a.micro} groups a micro-batch; {a.reps} alternated reps"
    )
    print(f"{'layout':<8}{'s/update median [min-max]':>30}{'tokens run':>12}")
    for k in layouts:
        t = times[k]
        print(f"{k:<8}{statistics.median(t):>12.3f} [{min(t):.3f}-{max(t):.3f}]{'':>4}{ran[k]:>12}")
    ratios = [p / s for p, s in zip(times["padded"], times["shared"], strict=True)]
    rel = ((grads["shared"] - grads["padded"]).abs().max() / grads["padded"].abs().max()).item()
    print(
        f"shared speed-up {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] over the reps; "
        f"max |grad shared - padded| / max |grad| = {rel:.1e} (float32)"
    )
    if a.json:
        out = {"model": model_dir.name, "args": {k: v for k, v in vars(a).items() if k != "json"}, "times": times}
        out.update(tokens=ran, speedup=ratios, grad_rel_diff=rel)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
