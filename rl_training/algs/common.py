"""What every objective shares: the group advantage, and the log-prob, entropy and k3 KL helpers; stated here
for Dr-GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783), the default.

- Advantage: A_i = r_i - mean_{group}(r). No division by the group's std (the paper's fix for the
  question-difficulty bias).
- Loss: `policy_loss(LossInput(OBJECTIVES["dr_grpo"], ...))` in algs/objectives.py (the one the trainer runs): the
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

from collections.abc import Callable, Sequence

import torch

Sizes = int | Sequence[int]  # every group's size, or each group's (base/groups.py Groups.sizes), group by group


def per_group(x: torch.Tensor, group_size: Sizes, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn applied to each group's values as the rows of a [groups, size] matrix, group by group -> [N]: one view
    when every group has one size, else each group alone (rollout.allocation: per_prompt's unequal groups)."""
    sizes = [group_size] if isinstance(group_size, int) else list(group_size)
    if len(set(sizes)) <= 1:
        size = sizes[0] if sizes else 1
        if x.numel() % size:
            raise ValueError(f"{x.numel()} values do not split into groups of {size}")
        return fn(x.view(-1, size)).reshape(-1)
    if x.numel() != sum(sizes):
        raise ValueError(f"{x.numel()} values for groups of {sum(sizes)}")
    return torch.cat([fn(g.view(1, -1)).reshape(-1) for g in x.split(sizes)])


def group_advantages(rewards: torch.Tensor, group_size: Sizes) -> torch.Tensor:
    """rewards [N] ordered group by group -> advantages [N], r - group mean, float64 (`group_size`: every group's
    size, or each group's).

    A group whose rewards are all equal gets exactly 0: its float mean need not equal them (eight float32
    copies of 5/7 average to 5/7 - 6e-8 in float32), and std-scaling objectives would blow that residue up
    to ~0.06 per sequence. Every objective's scale keeps those zeros exact, so `zero_adv_groups` finds exactly
    the groups whose max == min."""

    def center(r: torch.Tensor) -> torch.Tensor:
        centered = r - r.mean(dim=1, keepdim=True)
        return centered.masked_fill((r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1), 0.0)

    return per_group(rewards.double(), group_size, center)


def zero_adv_groups(advantages: torch.Tensor, group_size: int | Sequence[int]) -> torch.Tensor:
    """[N] -> [groups] bool: groups whose advantages are all exactly 0, i.e. (by `group_advantages`) the groups
    whose rewards are all equal; a non-constant group always keeps a non-zero advantage. `group_size`: every
    group's size, or each group's (Groups.sizes), group by group."""
    sizes = [group_size] if isinstance(group_size, int) else list(group_size)
    if len(set(sizes)) <= 1:
        return (advantages.view(-1, sizes[0] if sizes else 1) == 0).all(dim=1)
    return torch.stack([(a == 0).all() for a in advantages.split(sizes)])


# Elements of the float32 working copy of the logits per chunk (256 MiB): the full [B, L, V] copy would be
# ~20 GiB for 8 x 1024 tokens of a 152k vocabulary (Qwen2.5), once for the values and once for autograd.
CHUNK_ELEMENTS = 2**26


def _positions_per_chunk(logits: torch.Tensor, chunk_elements: int) -> int:
    b, _, v = logits.shape
    return max(1, chunk_elements // max(b * v, 1))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32 at least (float64 stays float64)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return x / temperature if temperature != 1.0 else x


class _ChosenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[target] computed chunk by chunk along the sequence. Autograd keeps only the
    logits themselves (in their own dtype) and one log-sum-exp per position; the backward rebuilds each
    chunk's softmax. Same formulas, in the same order, as autograd through gather - logsumexp."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_elements):
        c = _positions_per_chunk(logits, chunk_elements)
        out = torch.empty(targets.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, logits.shape[1], c):
            x = _scaled(logits[:, s : s + c], temperature)
            lse[:, s : s + c] = torch.logsumexp(x, dim=-1)
            out[:, s : s + c] = torch.gather(x, -1, targets[:, s : s + c].unsqueeze(-1)).squeeze(-1) - lse[:, s : s + c]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.c = temperature, c
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for s in range(0, logits.shape[1], ctx.c):
            go = grad_out[:, s : s + ctx.c].unsqueeze(-1)
            x = _scaled(logits[:, s : s + ctx.c], ctx.temperature)
            g = (-go) * torch.exp(x - lse[:, s : s + ctx.c].unsqueeze(-1))  # d(-logsumexp)
            g.scatter_add_(-1, targets[:, s : s + ctx.c].unsqueeze(-1), go)  # d(gather)
            grad[:, s : s + ctx.c] = g / ctx.temperature if ctx.temperature != 1.0 else g
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """log softmax(logits / T)[target] over the FULL vocabulary. logits [B,L,V], targets [B,L] -> [B,L].

    Computed in float32 at least, the same way for old, new and reference log-probs, so the PPO ratio
    compares like with like. In chunks of about `chunk_elements` logits: neither the forward nor autograd
    holds a float32 copy of the whole [B,L,V] tensor (see _ChosenLogprob).
    """
    return _ChosenLogprob.apply(logits, targets, temperature, chunk_elements)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position (nats). [B,L,V] -> [B,L]. Not the surprisal. In chunks
    along the sequence, like token_logprobs."""
    c = _positions_per_chunk(logits, chunk_elements)
    parts = []
    for s in range(0, logits.shape[1], c):
        logp = torch.log_softmax(_scaled(logits[:, s : s + c], temperature), dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts, dim=1) if parts else logits.new_zeros(logits.shape[:2], dtype=torch.float32)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0
