"""Effective sample size of the weights a step actually uses, as pure functions (spec: GNS_ESS.md 1.7).

Kish: ESS = (sum w)^2 / sum w^2, ness = ESS / N in [1/N, 1]; ESS = N for uniform weights, invariant to
scaling w. Everything is computed from sums that the caller all-reduces across ranks (the mean of per-rank
ESS is not the global ESS). N counts valid items before any masking; all-zero weights give ESS = 0 with
`defined = False`, never NaN. Sequence-level importance weights exp(sum_t log rho_t) are handled in the log
domain: w_i = exp(l_i - max_j l_j), so +-1000 nats stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KishSums:
    sum_w: float
    sum_w2: float
    n: float  # valid items (masked ones included, with weight 0)

    def __add__(self, other: KishSums) -> KishSums:
        return KishSums(self.sum_w + other.sum_w, self.sum_w2 + other.sum_w2, self.n + other.n)


@dataclass(frozen=True)
class ESS:
    ess: float  # absolute effective sample size
    ness: float  # normalised, ess / n
    defined: bool


def kish_sums(w: torch.Tensor, mask: torch.Tensor | None = None) -> KishSums:
    """Sums of weights w (any shape) over the valid entries (mask 1), in float64."""
    w = w.double()
    if mask is not None:
        m = mask.bool()
        w = w[m]
    return KishSums(w.sum().item(), (w * w).sum().item(), float(w.numel()))


def kish(s: KishSums) -> ESS:
    if s.sum_w2 <= 0 or s.n <= 0:
        return ESS(0.0, 0.0, False)
    ess = s.sum_w**2 / s.sum_w2
    return ESS(ess, ess / s.n, True)


def sequence_log_weights(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """l_i = sum_t log rho_t over each sequence's valid tokens. [B,L] -> [B], float64."""
    return (log_rho.double() * mask.double()).sum(-1)


def log_domain_sums(log_w: torch.Tensor, shift: float) -> KishSums:
    """Kish sums of w_i = exp(l_i - shift); pass the global max of l as `shift` (ESS is scale invariant)."""
    w = torch.exp(log_w.double() - shift)
    return KishSums(w.sum().item(), (w * w).sum().item(), float(w.numel()))


def group_ness(log_w: torch.Tensor, group_size: int) -> torch.Tensor:
    """ness of the sequence weights within each prompt group. [N] (group by group) -> [N/G], float64."""
    lw = log_w.double().view(-1, group_size)
    w = torch.exp(lw - lw.max(dim=1, keepdim=True).values)
    return w.sum(1) ** 2 / (w * w).sum(1) / group_size


def advantage_token_sums(adv: torch.Tensor, lengths: torch.Tensor) -> tuple[float, float, float]:
    """(sum_i T_i |A_i|, sum_i T_i A_i^2, sum_i T_i): ess/adv_token = (first)^2 / second / third."""
    a, t = adv.double(), lengths.double()
    return (t * a.abs()).sum().item(), (t * a * a).sum().item(), t.sum().item()


def adv_token_ness(s1: float, s2: float, tokens: float) -> float:
    return s1 * s1 / s2 / tokens if s2 > 0 and tokens > 0 else 0.0
