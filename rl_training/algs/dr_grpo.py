"""Dr-GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): the advantage, and the
log-prob, entropy and k3 KL helpers every objective shares.

- Advantage: A_i = r_i - mean_{group}(r). No division by the group's std (the paper's fix for the
  question-difficulty bias).
- Loss: `policy_loss(OBJECTIVES["dr_grpo"], ...)` in algs/objectives.py (the one the trainer runs): the
  per-token clipped surrogate -min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i), summed over every
  valid token of every sequence in the optimizer step and divided by ONE constant,
  (sequences in the step) x (max new tokens). No 1/|o_i| per-sequence length term (the paper's fix for the
  length bias). Because the normaliser is a constant, the gradient of a step is the sum of its
  micro-batches' gradients whatever the split, and padding never enters.
- Optional k3 KL penalty (Schulman's estimator, exp(q - p) - (q - p) - 1 with q the reference log-prob),
  per token, normalised by the same constant. The paper drops KL; kl_coef = 0 is the default.

Departures from the paper: decoupled clip bounds (eps_low / eps_high) are an option (equal by default);
`rho` may be multiplied by truncated importance weights supplied by the caller.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] ordered group by group (N = groups * group_size) -> advantages [N], r - group mean, float64.

    A group whose rewards are all equal gets exactly 0: its float mean need not equal them (eight float32
    copies of 5/7 average to 5/7 - 6e-8 in float32), and std-scaling objectives would blow that residue up
    to ~0.06 per sequence. Every objective's scale keeps those zeros exact, so `zero_adv_groups` finds exactly
    the groups whose max == min."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    constant = r.amax(dim=1) == r.amin(dim=1)
    return centered.masked_fill(constant.unsqueeze(1), 0.0).view(-1)


def zero_adv_groups(advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] -> [N/G] bool: groups whose advantages are all exactly 0, i.e. (by `group_advantages`) the groups
    whose rewards are all equal; a non-constant group always keeps a non-zero advantage."""
    return (advantages.view(-1, group_size) == 0).all(dim=1)


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
