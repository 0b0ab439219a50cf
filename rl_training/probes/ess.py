"""Effective sample size of the weights a step actually uses, as pure functions (docs/probes.md 1.7).

Kish: ESS = (sum w)^2 / sum w^2, ness = ESS / N in [1/N, 1]; ESS = N for uniform weights, invariant to
scaling w. Every ESS here (token, sequence, PPO ratio, advantage) is computed in the log domain: weights
w_i = exp(l_i) are kept as exp(shift) * sum exp(l_i - shift) with shift = the largest finite l_i, so log
ratios of +-1000 and weights from 1e-300 to 1e+300 neither overflow nor underflow, and the ESS (which does
not depend on the scale) is exact. Sums from several micro-batches or ranks are combined by rescaling to the
larger shift (the caller all-reduces the max shift first; the mean of per-rank ESS is not the global ESS).
N counts valid items before any masking. All-zero weights give ESS = 0 with `defined = False`; a NaN or +inf
weight (a corrupted log-prob) gives the defined critical reading ESS = 0, counted in `bad`, never an
exception and never a NaN that would silence the alert. Fields are 0-d float64 tensors on the inputs'
device, so a step's values reach the host in one transfer (the caller's), not one per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_training.probes.dashboard import ESS_CRITICAL, ESS_WARN


def _zero(device=None) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


@dataclass(frozen=True)
class LogKish:
    """sum w = exp(shift) s1 and sum w^2 = exp(2 shift) s2 over n valid items; `bad` of them NaN or +inf."""

    shift: torch.Tensor  # the largest finite log weight seen; -inf when there is none
    s1: torch.Tensor
    s2: torch.Tensor
    n: torch.Tensor
    bad: torch.Tensor

    @staticmethod
    def empty(device=None) -> LogKish:
        z = _zero(device)
        return LogKish(z - math.inf, z, z, z, z)

    def rescaled(self, shift: torch.Tensor) -> LogKish:
        """The same sums relative to a shift >= self.shift (an empty or all-zero part contributes 0)."""
        f = torch.where(self.shift == -math.inf, _zero(self.s1.device), torch.exp(self.shift - shift))
        return LogKish(shift, self.s1 * f, self.s2 * f * f, self.n, self.bad)

    def __add__(self, other: LogKish) -> LogKish:
        m = torch.maximum(self.shift, other.shift.to(self.shift.device))
        a, b = self.rescaled(m), other.rescaled(m)
        return LogKish(m, a.s1 + b.s1, a.s2 + b.s2, a.n + b.n, a.bad + b.bad)


def log_kish(log_w: torch.Tensor, mask: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> LogKish:
    """Log-domain Kish sums of w = exp(log_w) (any shape) over the valid entries (mask 1), each counted
    `counts` times (default 1). log_w = -inf is a weight of 0; NaN and +inf are counted as bad."""
    lw = log_w.detach().double()
    c = torch.ones_like(lw) if counts is None else counts.detach().double().expand_as(lw)
    if mask is not None:  # masked entries get count 0 (`where`, not indexing: no host sync on CUDA)
        c = torch.where(mask.bool(), c, 0.0)
    lw, c = lw.reshape(-1), c.reshape(-1)
    bad = (torch.isnan(lw) | (lw == math.inf)) & (c > 0)
    ok = torch.isfinite(lw) & (c > 0)
    shift = torch.where(ok, lw, -math.inf).max() if lw.numel() else _zero(lw.device) - math.inf
    x = torch.where(ok, lw - torch.where(torch.isfinite(shift), shift, 0.0), -math.inf)
    return LogKish(shift, (c * torch.exp(x)).sum(), (c * torch.exp(2 * x)).sum(), c.sum(), (c * bad).sum())


def weight_log(w: torch.Tensor) -> torch.Tensor:
    """log of non-negative weights in float64 (0 -> -inf; a negative or NaN weight -> NaN, counted bad)."""
    w = w.detach().double()
    return torch.where(w >= 0, torch.log(w.clamp_min(0)), math.nan)


@dataclass(frozen=True)
class ESS:
    ess: float  # absolute effective sample size
    ness: float  # normalised, ess / n
    defined: bool


def kish(shift: float, s1: float, s2: float, n: float, bad: float) -> ESS:
    """The ESS from (global) log-domain sums, as host floats. A bad weight is the critical reading 0."""
    if bad > 0:
        return ESS(0.0, 0.0, True)
    if not s2 > 0 or n <= 0 or shift == -math.inf:
        return ESS(0.0, 0.0, False)
    ess = s1 * s1 / s2  # the largest weight contributes exp(0) = 1 to s1 and s2: no overflow, no underflow
    return ESS(ess, ess / n, True)


def kish_of(s: LogKish) -> ESS:
    """kish() of a local LogKish (tests and single-process use)."""
    return kish(*(float(v) for v in (s.shift, s.s1, s.s2, s.n, s.bad)))


def sequence_log_weights(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """l_i = sum_t log rho_t over each sequence's valid tokens. [B,L] -> [B], float64. Pad positions are
    excluded with `where` (a NaN or inf there times a 0 mask would be NaN)."""
    return torch.where(mask.bool(), log_rho.double(), 0.0).sum(-1)


def group_ness(log_w: torch.Tensor, group_size: int | Sequence[int]) -> torch.Tensor:
    """ness of the sequence weights within each prompt group. [N] (group by group) -> [groups], float64; the size of
    every group, or each group's. A group with a NaN or +inf log weight reads 0 (critical); one with every weight 0
    (all -inf) reads 0 too."""
    sizes = [group_size] if isinstance(group_size, int) else list(group_size)
    if len(set(sizes)) > 1:
        return torch.cat([group_ness(g, g.numel()) for g in log_w.split(sizes)])
    group_size = sizes[0] if sizes else 1
    lw = log_w.double().view(-1, group_size)
    bad = (torch.isnan(lw) | (lw == math.inf)).any(1)
    ok = torch.isfinite(lw)
    shift = torch.where(ok, lw, -math.inf).max(dim=1, keepdim=True).values
    w = torch.where(ok, torch.exp(lw - torch.where(torch.isfinite(shift), shift, 0.0)), 0.0)
    s2 = (w * w).sum(1)
    ness = torch.where(s2 > 0, w.sum(1) ** 2 / torch.where(s2 > 0, s2, 1.0) / group_size, 0.0)
    return torch.where(bad, 0.0, ness)


def nan_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.nanquantile(x, q) (linear interpolation, NaNs skipped; NaN when all are) without its limit of 2^24
    elements, which a long-context step's token count passes (issue 29, N9): one sort, NaNs last. No host sync."""
    x = x.reshape(-1)
    valid = ~torch.isnan(x)
    s, _ = torch.sort(torch.where(valid, x, torch.inf))
    n = valid.sum()
    pos = (n - 1).clamp(min=0).to(torch.float64) * q  # float64: q * an int tensor would be float32
    lo, hi = pos.floor().long(), pos.ceil().long()
    a, b = s.index_select(0, lo.reshape(1))[0], s.index_select(0, hi.reshape(1))[0]  # s[lo] would sync (int())
    frac = (pos - lo).to(s.dtype)
    out = torch.where(frac == 0, a, a + frac * (b - a))  # an infinite value stays itself (inf - inf is NaN)
    return torch.where(n > 0, out, torch.full_like(out, math.nan))


def step_metrics(ess: dict, t: dict, p999: float, groups: list[float], bad: float) -> dict[str, float]:
    """The step's probe/ess/* and is/* from the reduced ESS accumulators `ess`, the token sums `t`, the 99.9th
    percentile ratio `p999`, the sorted group ESS values `groups` and the non-finite weight count `bad`."""
    tok, tok_raw, sq, ppo = ess["tok_used"], ess["tok_raw"], ess["seq"], ess["ppo"]
    n_tok = max(t["tok"], 1.0)
    lr_mean = t["lr.sum"] / n_tok
    return {
        "probe/ess/token": tok.ness,
        "probe/ess/token_raw": tok_raw.ness,
        "probe/ess/seq": sq.ness,
        "probe/ess/seq_abs": sq.ess,
        "probe/ess/group_min": groups[0] if groups else math.nan,
        "probe/ess/group_median": groups[(len(groups) - 1) // 2] if groups else math.nan,  # lower median
        "probe/ess/ppo_token": ppo.ness if ppo.defined else 1.0,  # one epoch: the PPO ratio is exactly 1
        "probe/ess/adv_seq": ess["adv_seq"].ness,
        "probe/ess/adv_token": ess["adv_tok"].ness,
        "probe/ess/defined": float(tok.defined and tok_raw.defined),
        "probe/ess/nonfinite": bad,  # NaN or +inf token weights this step (a corrupted log-prob): ESS 0
        "probe/ess/ref_warn": ESS_WARN,  # constant reference lines for the off-policy chart
        "probe/ess/ref_critical": ESS_CRITICAL,
        # is/ratio_mean, is/ratio_max and is/trunc_frac come with the trainer's rollout canary.
        "is/log_ratio_mean": lr_mean,
        "is/log_ratio_std": math.sqrt(max(t["lr.sq"] / n_tok - lr_mean**2, 0.0)),
        "is/ratio_p99_9": p999,  # max over ranks of each rank's 99.9th percentile
        "is/kl_k1": t["k1"] / n_tok,
        "is/kl_k3": t["k3"] / n_tok,
        "is/chi2_token": t["rho2"] / n_tok - 1.0,
        "is/chi2_seq": (1.0 / sq.ness - 1.0) if sq.defined and sq.ness > 0 else math.nan,
    }
