"""Helpers shared by the trainer and objective tests: a float64 LoRA policy, fake rollouts, one update."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import torch

from rl_training.algs.objectives import OBJECTIVES, StepNorm
from rl_training.config.schema import LoraCfg
from rl_training.policy.models import apply_lora, trainable_parameters
from rl_training.rollout.base import Rollouts
from rl_training.train.update import NULL_PROBES, UpdateHParams, make_micro_batches, train_on_rollouts

G = 2  # completions per prompt in the fake rollouts


def lora_policy(model_dir, seed: int = 0):
    """The tiny model in float64 with a LoRA adapter whose B matrices are random (B = 0 would zero every A
    gradient). sdpa, the default: transformers 5's eager path shifts logits by ~1e-7 when every row is padded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model = apply_lora(base, LoraCfg(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def fake_rollouts(n_groups: int, seed: int = 0) -> Rollouts:
    """Random prompts (3-8 tokens) and completions (1-6 tokens); sampler log-probs all -1."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps, lps = [], [], []
    for _ in range(n_groups):
        p = torch.randint(2, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            c = torch.randint(2, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            prompts.append(p)
            comps.append(c)
            lps.append([-1.0] * len(c))
    return Rollouts(prompts, comps, lps, [False] * len(comps), [""] * len(comps))


def with_observations(ro: Rollouts, obs_logp: float = 5.0, seed: int = 1) -> Rollouts:
    """`ro` made multi-turn: each completion split after its first token by a 2-4 token observation (mask 0,
    turn 0, sampler log-prob `obs_logp`: nonsense that nothing may read); the tokens after it are turn 2."""
    g = torch.Generator().manual_seed(seed)
    comps, lps, masks, turns = [], [], [], []
    for c, lp in zip(ro.completion_ids, ro.logprobs, strict=True):
        obs = torch.randint(2, 200, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        comps.append(c[:1] + obs + c[1:])
        lps.append(lp[:1] + [obs_logp] * len(obs) + lp[1:])
        masks.append([1] + [0] * len(obs) + [1] * (len(c) - 1))
        turns.append([1] + [0] * len(obs) + [2] * (len(c) - 1))
    return Rollouts(ro.prompt_ids, comps, lps, ro.truncated, ro.texts, loss_mask=masks, turn_index=turns)


def grads_after(
    model,
    rollouts,
    adv,
    groups_per_micro,
    *,
    extra_pad=0,
    kl_coef=0.0,
    drop=False,
    epochs=1,
    objective="dr_grpo",
    tis_cap=0.0,
    pack_row_tokens=None,
    probes=None,
):
    """Run one update with lr 0 and no clipping; return the flat gradient of the last epoch and the stats."""
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mbs = make_micro_batches(
        rollouts, adv, G, groups_per_micro, 0, torch.device("cpu"), drop, extra_pad, pack_row_tokens
    )
    o = OBJECTIVES[objective]
    hp = UpdateHParams(
        objective=o,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        inner_epochs=epochs,
        kl_coef=kl_coef,
        max_grad_norm=0.0,
        tis_cap=tis_cap,
    )
    norm = StepNorm(
        seqs=len(rollouts), tokens=sum(rollouts.trainable(i) for i in range(len(rollouts))), max_new_tokens=8
    )
    stats = train_on_rollouts(model, opt, sched, params, mbs, hp, norm, NULL_PROBES if probes is None else probes)
    return torch.cat([p.grad.reshape(-1).clone() for p in params]), stats


# ------------------------------------------------------------------------------------------- paths, configs
REPO = Path(__file__).resolve().parents[1]
TESTCFG = str(REPO / "cfg" / "testconfig.yaml")
SFT_CFG = str(REPO / "cfg" / "tiny_sft.yaml")
FIXTURES = REPO / "tests" / "fixtures"
WORKERS = REPO / "tests" / "workers"
RL_RUNNER = str(REPO / "rl_training" / "runners" / "rl_runner.py")
VLLM = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1"]  # the colocated engine at a CPU-sized KV cache


def data_overrides(reverse_data: Path) -> list[str]:
    return [f"data.train={reverse_data / 'train.jsonl'}", f"data.eval={reverse_data / 'heldout.jsonl'}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ docs/extending.md
DOC_EXTENDING = REPO / "docs" / "extending.md"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```\n", re.M | re.S)


def doc_blocks(path: Path = DOC_EXTENDING) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a docs page, in order."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(path.read_text())]


def doc_file(name: str, path: Path = DOC_EXTENDING) -> str:
    """The body of the page's `# file: NAME` block (a task file the page shows whole)."""
    (body,) = [b for _, b in doc_blocks(path) if b.startswith(f"# file: {name}\n")]
    return body


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
