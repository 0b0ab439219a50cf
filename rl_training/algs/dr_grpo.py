"""Dr-GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783), as pure functions.

- Advantage: A_i = r_i - mean_{group}(r). No division by the group's std (the paper's fix for the
  question-difficulty bias).
- Loss: per-token clipped surrogate  -min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i),  summed over
  every valid token of every sequence in the optimizer step and divided by ONE constant,
  normalizer = (sequences in the step) x (max new tokens). No 1/|o_i| per-sequence length term (the
  paper's fix for the length bias). Because the normaliser is a constant, the gradient of a step is the
  sum of its micro-batches' gradients whatever the split, and padding never enters.
- Optional k3 KL penalty (Schulman's estimator, exp(q - p) - (q - p) - 1 with q the reference log-prob),
  per token, normalised by the same constant. The paper drops KL; kl_coef = 0 is the default.

Departures from the paper: decoupled clip bounds (eps_low / eps_high) are an option (equal by default);
`rho` may be multiplied by truncated importance weights supplied by the caller.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] ordered group by group (N = groups * group_size) -> advantages [N], r - group mean."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] over the FULL vocabulary. logits [B,L,V], targets [B,L] -> [B,L].

    Computed in float32 at least, the same way for old, new and reference log-probs, so the PPO ratio
    compares like with like. gather - logsumexp avoids materialising the whole log-softmax.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        x = x / temperature
    picked = torch.gather(x, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position (nats). [B,L,V] -> [B,L]. Not the surprisal."""
    x = logits.float() / temperature
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


class LossOut(NamedTuple):
    loss: torch.Tensor  # scalar: this micro-batch's share of the step loss (already / normalizer)
    pg_loss: torch.Tensor  # scalar, detached: the policy-gradient part
    kl_sum: torch.Tensor  # scalar, detached: sum of per-token k3 KL over valid tokens
    clipped_tokens: torch.Tensor  # scalar, detached: tokens whose gradient the clip removed
    tokens: torch.Tensor  # scalar, detached: valid tokens


def dr_grpo_loss(
    logp: torch.Tensor,  # [B,L] log-probs under the current policy (requires grad)
    old_logp: torch.Tensor,  # [B,L] log-probs under the policy that generated the batch
    advantages: torch.Tensor,  # [B] one per sequence
    mask: torch.Tensor,  # [B,L] 1 on completion tokens (EOS included), 0 on prompt / padding
    normalizer: float,  # the step constant: sequences in the optimizer step x max_new_tokens
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: torch.Tensor | None = None,  # [B,L] reference log-probs, for the KL penalty
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,  # [B,L] optional truncated importance weights (no grad)
) -> LossOut:
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    pg = (per_token * mask).sum() / normalizer
    loss = pg
    kl_sum = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        kl_tok = k3_kl(logp, ref_logp.detach())
        kl_sum = (kl_tok * mask).sum()
        if kl_coef:
            loss = loss + kl_coef * kl_sum / normalizer
    # The clip removes the gradient exactly where min() picks the clamped term and the clamp is active.
    was_clipped = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))
    return LossOut(
        loss=loss,
        pg_loss=pg.detach(),
        kl_sum=kl_sum.detach(),
        clipped_tokens=(was_clipped.to(mask.dtype) * mask).sum().detach(),
        tokens=mask.sum().detach(),
    )
