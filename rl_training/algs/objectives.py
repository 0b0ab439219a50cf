"""The policy-gradient objectives of our peers, as pure functions chosen once at setup from `loss.type`.

Every objective is three choices, each a function (no string switches in the training step):
  1. advantages: a baseline (group mean, or leave-one-out) and a scale (none, group std, batch std);
  2. a per-token surrogate: PPO's clipped ratio, GSPO's clipped sequence ratio, or CISPO's clipped,
     stop-gradient importance weight times log-prob;
  3. an aggregation with a normaliser that is constant for the optimizer step (so every objective's gradient
     is the sum of its micro-batches' gradients, whatever the split):
       step_constant        sum over tokens / (sequences in the step x max_new_tokens)     [Dr-GRPO]
       seq_mean_token_mean  (1/sequences) sum_i (1/|o_i|) sum_t                          [GRPO, GSPO]
       seq_mean_token_sum   (1/sequences) sum_i sum_t                                    [RLOO]
       token_mean           sum over tokens / (valid tokens in the step)                 [DAPO, CISPO, REINFORCE++]
     "sequences" and "valid tokens" count the whole optimizer step over all ranks (divided by the world size,
     because the gradient all-reduce averages ranks), including zero-advantage groups that
     `train.drop_zero_adv_groups` skips. Without a KL term skipping them saves compute and never changes the
     gradient: a group is skipped only when its advantages are exactly 0, so every objective's surrogate
     there is 0 with zero gradient. A KL term would still move those groups, so the config refuses
     `train.drop_zero_adv_groups` with `loss.kl_coef > 0`.

Papers and departures (each objective's entry below names its paper):
- Dr-GRPO: Liu et al. 2025, arXiv:2503.20783. Exact: `OBJECTIVES["dr_grpo"]` below (advantage in
  algs/common.py).
- GRPO: Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300. Advantages (r - mean)/(std + 1e-6) with the
  unbiased group std; per-sequence token mean, then mean over sequences. Departure: the paper adds a k3 KL
  to the reference in the loss with beta = 0.04; here the KL is the shared option, off by default
  (`loss.kl_coef=0`); `loss.kl_coef=0.04 loss.kl_estimator=k3` gives the paper's.
- DAPO: Yu et al. 2025, arXiv:2503.14476. Clip-higher (0.2 / 0.28) and the token-level mean over the step.
  Not included: dynamic sampling (re-sampling prompts until the batch is full of informative groups) and
  overlong reward shaping; `train.drop_zero_adv_groups` only skips degenerate groups.
- GSPO: Zheng et al. 2025, arXiv:2507.18071. Sequence ratio s_i = exp(mean_t log(pi/pi_old)), clipped at
  1-3e-4 / 1+4e-4, mean over sequences. Truncated IS weights, when enabled, are averaged over the
  sequence's tokens (arithmetic mean), where verl uses the geometric mean.
- CISPO: MiniMax 2025 (MiniMax-M1), arXiv:2506.13585. -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi,
  token mean over the step; no lower bound by default (eps_low = 1), eps_high = 0.28.
- RLOO: Ahmadian et al. 2024, arXiv:2402.14740 (Kool et al. 2019). Leave-one-out baseline
  A_i = r_i - mean_{j != i} r_j; REINFORCE on the whole sequence (token sum), mean over sequences. Departures:
  the PPO clipped ratio is kept so inner epochs stay well defined (with one epoch the ratio is exactly 1 and
  the gradient is plain REINFORCE); the paper subtracts the KL penalty from the reward (so it enters the
  baseline and the advantage), here it is the shared KL-in-loss option (off by default).
- REINFORCE++ with baseline: Hu 2025, arXiv:2501.03262. A_i = (r_i - group mean) / std over the whole
  step's batch (all ranks), PPO clip, token mean. Departure: the batch std is taken over sequences; verl
  whitens over tokens (each sequence weighted by its length). The paper's KL-in-reward is replaced by the
  shared KL-in-loss option.
KL (`loss.kl_estimator`, see `KL_ESTIMATORS`) is added per token, `kl_coef * term_t`, before aggregation.
Differentiating an unbiased KL estimate does not give an unbiased KL gradient (Tang & Munos 2025, "On a few
pitfalls in KL divergence gradient estimation for RL", arXiv:2506.09477): naive k1 in the loss has zero
expected gradient. So k1's loss term keeps k1's value but carries the gradient
sg(w (log pi - log ref)) grad log pi, whose expectation is grad KL(pi || ref) per token (k2's gradient); k3
is differentiated as TRL and the GRPO paper do, which on-policy gives grad KL(ref || pi), the forward KL.
Both are per-token penalties: neither carries a token's effect on the KL of later tokens (the paper's
second pitfall).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rl_training.algs.common import Sizes, group_advantages, k3_kl, per_group

ADV_EPS = 1e-6


# ------------------------------------------------------------------------------------------- advantages
def leave_one_out_advantages(rewards: torch.Tensor, group_size: Sizes) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_j r_j), G each group's size. rewards [N] group by group
    -> [N]."""

    def rescale(c: torch.Tensor) -> torch.Tensor:  # a group of one has no other to compare with: it stays 0
        return c * (c.shape[1] / max(c.shape[1] - 1, 1))

    return per_group(group_advantages(rewards, group_size), group_size, rescale)


def group_std_scale(centered: torch.Tensor, group_size: Sizes) -> torch.Tensor:
    """Divide each group's centered rewards by that group's (unbiased) reward std + eps (GRPO); a group of one,
    whose unbiased std is undefined, keeps its advantage 0."""

    def scale(c: torch.Tensor) -> torch.Tensor:
        return c / ((c.std(dim=1, keepdim=True) if c.shape[1] > 1 else torch.zeros_like(c[:, :1])) + ADV_EPS)

    return per_group(centered, group_size, scale)


def no_scale(centered: torch.Tensor, group_size: Sizes) -> torch.Tensor:
    return centered


def batch_moments(x: torch.Tensor) -> dict[str, float]:
    """Sums the caller all-reduces across ranks before `batch_std_scale` (count, sum, sum of squares)."""
    return {"n": float(x.numel()), "s": x.double().sum().item(), "s2": (x.double() ** 2).sum().item()}


def batch_std_scale(centered: torch.Tensor, moments: dict[str, float]) -> torch.Tensor:
    """Divide by the unbiased std of the whole step's centered rewards (REINFORCE++), from global moments."""
    n, s, s2 = moments["n"], moments["s"], moments["s2"]
    var = max(s2 - s * s / n, 0.0) / max(n - 1.0, 1.0)
    return centered / (math.sqrt(var) + ADV_EPS)


# ------------------------------------------------------------------------------------------- surrogates
class Surrogate(NamedTuple):
    per_token: torch.Tensor  # [B,L] loss per token before aggregation (masked positions are ignored later)
    clipped: torch.Tensor  # [B,L] bool: tokens whose update the clip removed or whose weight it truncated


def ppo_clip_surrogate(logp, old_logp, adv, mask, clip_low, clip_high) -> Surrogate:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old_logp) per token."""
    ratio = torch.exp(logp - old_logp.detach())
    a = adv.unsqueeze(1)
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * a)
    clipped = ((ratio > 1.0 + clip_high) & (a > 0)) | ((ratio < 1.0 - clip_low) & (a < 0))
    return Surrogate(per_token, clipped)


def gspo_surrogate(logp, old_logp, adv, mask, clip_low, clip_high) -> Surrogate:
    """Sequence ratio s_i = exp(mean over valid tokens of log r_t); -min(s A, clip(s) A), on every token of i."""
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp.detach()) * m).sum(1) / m.sum(1).clamp(min=1.0)
    s = torch.exp(log_s)
    seq_loss = -torch.minimum(s * adv, torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high) * adv)
    clipped = ((s > 1.0 + clip_high) & (adv > 0)) | ((s < 1.0 - clip_low) & (adv < 0))
    return Surrogate(seq_loss.unsqueeze(1).expand_as(logp), clipped.unsqueeze(1).expand_as(logp))


def cispo_surrogate(logp, old_logp, adv, mask, clip_low, clip_high) -> Surrogate:
    """-sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp: clipping truncates the weight, never the gradient."""
    ratio = torch.exp(logp.detach() - old_logp.detach())
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * adv.unsqueeze(1) * logp
    return Surrogate(per_token, (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low))


# ----------------------------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class StepNorm:
    """Normalisers of one optimizer step, per rank (global count / world size: DDP averages ranks)."""

    seqs: float  # sequences in the step
    tokens: float  # valid completion tokens in the step
    max_new_tokens: int


def step_constant(per_token, mask, norm: StepNorm) -> torch.Tensor:
    return (per_token * mask).sum() / (norm.seqs * norm.max_new_tokens)


def seq_mean_token_mean(per_token, mask, norm: StepNorm) -> torch.Tensor:
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum() / norm.seqs


def seq_mean_token_sum(per_token, mask, norm: StepNorm) -> torch.Tensor:
    return (per_token * mask).sum() / norm.seqs


def token_mean(per_token, mask, norm: StepNorm) -> torch.Tensor:
    return (per_token * mask).sum() / norm.tokens


# ------------------------------------------------------------------------------------------------ KL
def k1_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi || ref): log pi - log ref (unbiased, can be negative)."""
    return logp - ref_logp


def k1_kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """k1's value, log pi - log ref, with the gradient sg(weight (log pi - log ref)) grad log pi.

    The naive gradient of k1 is grad log pi(y), whose expectation under y ~ pi is 0: noise and no pull to
    the reference (arXiv:2506.09477). Sum_y pi(y) (log pi(y) - log ref(y)) grad log pi(y) = grad KL(pi || ref)
    instead: the gradient of k2 = (log pi - log ref)^2 / 2, i.e. of a per-token reward -k1. The tokens were drawn
    by the sampler, not by pi, so `weight` = (truncated IS weight, when on) x pi / pi_old per token, the
    unclipped importance weight of the PG term (1 in the first epoch): its expectation is then the same.
    """
    k1 = logp - ref_logp
    return k1.detach() + (weight * k1).detach() * (logp - logp.detach())


def k3_kl_loss(logp: torch.Tensor, ref_logp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """k3 differentiated as it is (TRL, the GRPO paper): gradient (1 - ref/pi) grad log pi, whose expectation
    under y ~ pi is -sum_y ref(y) grad log pi(y) = grad KL(ref || pi), the forward KL; not importance-weighted."""
    return k3_kl(logp, ref_logp)


class KLEstimator(NamedTuple):
    value: Callable  # (logp, ref_logp) -> [B,L] per-token KL estimate, logged as train/kl
    loss_term: Callable  # (logp, ref_logp, weight [B,L] no grad) -> [B,L] penalty added to the loss x kl_coef


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": KLEstimator(k1_kl, k1_kl_loss), "k3": KLEstimator(k3_kl, k3_kl_loss)}


# ----------------------------------------------------------------------------------------- objectives
@dataclass(frozen=True)
class Objective:
    name: str
    paper: str
    baseline: Callable[[torch.Tensor, int], torch.Tensor]  # rewards [N], G -> centered [N]
    scale: Callable | None  # (centered, G) -> advantages; None = batch std from global moments
    surrogate: Callable[..., Surrogate]
    aggregate: Callable[[torch.Tensor, torch.Tensor, StepNorm], torch.Tensor]
    clip_low: float  # paper defaults, used when loss.clip_low / clip_high are left unset
    clip_high: float

    @property
    def needs_batch_moments(self) -> bool:
        return self.scale is None


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in [
        Objective(
            "dr_grpo", "arXiv:2503.20783", group_advantages, no_scale, ppo_clip_surrogate, step_constant, 0.2, 0.2
        ),
        Objective(
            "grpo",
            "arXiv:2402.03300",
            group_advantages,
            group_std_scale,
            ppo_clip_surrogate,
            seq_mean_token_mean,
            0.2,
            0.2,
        ),
        Objective(
            "dapo", "arXiv:2503.14476", group_advantages, group_std_scale, ppo_clip_surrogate, token_mean, 0.2, 0.28
        ),
        Objective(
            "gspo",
            "arXiv:2507.18071",
            group_advantages,
            group_std_scale,
            gspo_surrogate,
            seq_mean_token_mean,
            3e-4,
            4e-4,
        ),
        Objective(
            "cispo", "arXiv:2506.13585", group_advantages, group_std_scale, cispo_surrogate, token_mean, 1.0, 0.28
        ),
        Objective(
            "rloo",
            "arXiv:2402.14740",
            leave_one_out_advantages,
            no_scale,
            ppo_clip_surrogate,
            seq_mean_token_sum,
            0.2,
            0.2,
        ),
        Objective("reinforce_pp", "arXiv:2501.03262", group_advantages, None, ppo_clip_surrogate, token_mean, 0.2, 0.2),
    ]
}


class LossOut(NamedTuple):
    loss: torch.Tensor  # scalar: this micro-batch's share of the step loss
    pg_loss: torch.Tensor  # scalar, detached: the policy-gradient part
    kl_sum: torch.Tensor  # scalar, detached: token sum of the KL estimate over valid tokens
    clipped_tokens: torch.Tensor  # scalar, detached
    tokens: torch.Tensor  # scalar, detached: valid tokens


@dataclass(frozen=True)
class LossInput:
    """One micro-batch's loss inputs (built with keywords by the trainer; the field order is the tests')."""

    objective: Objective
    logp: torch.Tensor  # [B,L] current policy log-probs (requires grad)
    old_logp: torch.Tensor  # [B,L] log-probs of the policy before this step's first update
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B,L] 1 on completion tokens
    norm: StepNorm
    clip_low: float
    clip_high: float
    ref_logp: torch.Tensor | None = None  # [B,L]
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KL_ESTIMATORS["k3"]
    is_weights: torch.Tensor | None = None  # [B,L] the off-policy correction's weights (algs/corrections.py; no grad)


def policy_loss(x: LossInput) -> LossOut:
    objective, logp, old_logp, norm, is_weights = x.objective, x.logp, x.old_logp, x.norm, x.is_weights
    mask = x.mask.to(logp.dtype)
    adv = x.advantages.detach().to(logp.dtype)
    sur = objective.surrogate(logp, old_logp, adv, mask, x.clip_low, x.clip_high)
    per_token = sur.per_token if is_weights is None else sur.per_token * is_weights.detach()
    pg = objective.aggregate(per_token, mask, norm)
    loss, kl_sum = pg, torch.zeros((), dtype=logp.dtype, device=logp.device)
    ref_logp, kl_estimator = x.ref_logp, x.kl_estimator
    if ref_logp is not None:
        kl_sum = (kl_estimator.value(logp.detach(), ref_logp.detach()) * mask).sum()
        if x.kl_coef:
            weight = torch.exp(logp.detach() - old_logp.detach())
            if is_weights is not None:
                weight = weight * is_weights.detach()
            kl_tok = kl_estimator.loss_term(logp, ref_logp.detach(), weight)
            loss = loss + x.kl_coef * objective.aggregate(kl_tok, mask, norm)
    return LossOut(
        loss, pg.detach(), kl_sum.detach(), (sur.clipped.to(mask.dtype) * mask).sum().detach(), mask.sum().detach()
    )
