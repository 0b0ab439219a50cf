"""One RL update: rollouts -> micro-batches -> Dr-GRPO loss -> accumulated, all-reduced, clipped step.

Old log-probs come for free and exactly: the first inner epoch's forward passes run on the weights before
any update of this step, which is the policy the PPO ratio compares against. Their detached values are
kept and reused by later epochs, so old and new log-probs are computed the same way (full vocabulary,
same precision, same temperature) and the ratio is exactly 1 in epoch 0. The sampler's own log-probs
only feed the trainer-vs-rollout canary (and truncated IS, when enabled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_training import dist
from rl_training.algs.dr_grpo import dr_grpo_loss, token_entropy, token_logprobs
from rl_training.rollout.base import Rollouts


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B,T] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B,T] 1 on real tokens
    targets: torch.Tensor  # [B,T-1] input_ids shifted left: the token each position predicts
    mask: torch.Tensor  # [B,T-1] 1 where the target is a completion token (stop token included)
    advantages: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B,T-1] sampler log-probs aligned with `mask`, 0 elsewhere
    group_ids: list[int]  # [B/G] indices of the groups in this micro-batch


def make_micro_batches(
    rollouts: Rollouts,
    advantages: torch.Tensor,
    group_size: int,
    groups_per_micro: int,
    pad_id: int,
    device: torch.device,
    drop_zero_adv_groups: bool = False,
    extra_pad: int = 0,
) -> list[MicroBatch]:
    """Pack whole prompt groups into micro-batches (a group is never split)."""
    n_groups = len(rollouts) // group_size
    groups = list(range(n_groups))
    if drop_zero_adv_groups:
        adv = advantages.view(n_groups, group_size)
        groups = [g for g in groups if bool((adv[g] != 0).any())]
    out = []
    for s in range(0, len(groups), groups_per_micro):
        gids = groups[s : s + groups_per_micro]
        rows = [g * group_size + i for g in gids for i in range(group_size)]
        seqs = [rollouts.prompt_ids[r] + rollouts.completion_ids[r] for r in rows]
        width = max(len(x) for x in seqs) + extra_pad
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        rlogp = torch.zeros((len(rows), width - 1))
        for b, r in enumerate(rows):
            p, c = len(rollouts.prompt_ids[r]), len(rollouts.completion_ids[r])
            ids[b, : p + c] = torch.tensor(seqs[b])
            attn[b, : p + c] = 1
            # position t predicts token t+1: completion tokens p..p+c-1 are predicted at p-1..p+c-2
            mask[b, p - 1 : p + c - 1] = 1
            rlogp[b, p - 1 : p + c - 1] = torch.tensor(rollouts.logprobs[r][:c])
        out.append(
            MicroBatch(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                targets=ids[:, 1:].to(device),
                mask=mask.to(device),
                advantages=advantages[rows].to(device),
                rollout_logp=rlogp.to(device),
                group_ids=gids,
            )
        )
    return out


def forward_logits(model, mb: MicroBatch) -> torch.Tensor:
    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]


@dataclass
class TrainStats:
    """Sums over this rank's micro-batches and epochs (the caller reduces across ranks)."""

    loss: float  # sum over epochs of the step loss (Dr-GRPO: already / normalizer)
    pg_loss: float
    kl_sum: float  # token sum of k3 KL to the reference, epoch 0
    clipped_tokens: float  # summed over epochs
    tokens: float  # valid tokens in one epoch
    entropy_sum: float  # token sum of policy entropy, epoch 0
    logp_absdiff_sum: float  # token sum of |trainer - sampler| log-prob, epoch 0
    logp_absdiff_max: float
    grad_norm: float  # mean over epochs of the pre-clip global grad norm (after the all-reduce)
    epochs: int


def train_on_rollouts(
    model,
    optimizer,
    scheduler,
    params: list[torch.nn.Parameter],
    micro_batches: list[MicroBatch],
    *,
    normalizer: float,
    inner_epochs: int,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    log_kl: bool,
    temperature: float,
    max_grad_norm: float,
) -> TrainStats:
    # Eval mode: no dropout anywhere, so epoch-0 log-probs equal a separate no-grad "old" pass.
    model.eval()
    old_logps: list[torch.Tensor] = []
    ref_logps: list[torch.Tensor | None] = []
    s = dict(
        loss=0.0,
        pg_loss=0.0,
        kl_sum=0.0,
        clipped_tokens=0.0,
        tokens=0.0,
        entropy_sum=0.0,
        logp_absdiff_sum=0.0,
        logp_absdiff_max=0.0,
        grad_norm=0.0,
    )
    for epoch in range(inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(micro_batches):
            if epoch == 0 and (kl_coef > 0 or log_kl):
                with torch.no_grad(), model.disable_adapter():
                    ref_logps.append(token_logprobs(forward_logits(model, mb), mb.targets, temperature))
            elif epoch == 0:
                ref_logps.append(None)
            logits = forward_logits(model, mb)
            logp = token_logprobs(logits, mb.targets, temperature)
            if epoch == 0:
                old_logps.append(logp.detach())
                m = mb.mask.bool()
                diff = (logp.detach() - mb.rollout_logp).abs()[m]
                s["logp_absdiff_sum"] += diff.sum().item()
                s["logp_absdiff_max"] = max(s["logp_absdiff_max"], diff.max().item() if diff.numel() else 0.0)
                s["entropy_sum"] += token_entropy(logits.detach(), temperature)[m].sum().item()
            out = dr_grpo_loss(
                logp, old_logps[i], mb.advantages, mb.mask, normalizer, clip_low, clip_high, ref_logps[i], kl_coef
            )
            out.loss.backward()
            s["loss"] += out.loss.item()
            s["pg_loss"] += out.pg_loss.item()
            s["clipped_tokens"] += out.clipped_tokens.item()
            if epoch == 0:
                s["kl_sum"] += out.kl_sum.item()
                s["tokens"] += out.tokens.item()
        for p in params:  # a rank whose groups were all dropped still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dist.average_gradients_(params)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        s["grad_norm"] += norm.item()
        optimizer.step()
        scheduler.step()
    s["grad_norm"] /= inner_epochs
    return TrainStats(**s, epochs=inner_epochs)
