"""Off-policy corrections: per-token weights for the tokens the sampler drew where the trainer's policy disagrees.

The trainer's log-prob of a sampled token (pi_old: the policy before this step's first update, computed in epoch
0) and the sampler's (pi_rollout: vLLM's kernels and precision, or with rollout.max_async_level > 0 an older
policy) differ; rho_t = pi_old(y_t) / pi_rollout(y_t) measures it per token. A correction turns rho into a weight
w_t >= 0 that multiplies the objective's per-token surrogate (and the k1 KL term's importance weight), chosen once
at setup from `loss.correction` (a built-in below, or a user's Correction subclass: docs/extending.md):

  tis           w_t = min(rho_t, cap)                           truncated importance sampling (Yao et al. 2025)
  token_mask    w_t = 1 if low <= rho_t <= high else 0           a token outside the band teaches nothing
  seq_geo_mask  w_t = 1 if low <= exp(mean_t log rho_t) <= high  a sequence whose geometric-mean ratio leaves
                    else 0, for every token of the sequence       the band teaches nothing

Departures: masked tokens stay in the objective's normaliser (the step's token count is fixed before the first
forward, so the gradient stays the sum of its micro-batches'); verl removes rejected tokens from the denominator,
which for token-mean objectives rescales the step by 1 / (1 - masked fraction). seq_geo_mask weights kept tokens
by 1, where NeMo-RL's seq-mask-tis multiplies them by rho_t. Our names beside verl's, prime-rl's, SkyRL's and
NeMo-RL's: docs/objectives.md.

Each correction also returns counts under the names they are logged as (each summed over the step and divided by
the step's tokens or sequences); the weights are 0 off the mask and carry no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal, NamedTuple

import torch


class CorrectionOut(NamedTuple):
    weights: torch.Tensor  # [B,L] w_t >= 0 on completion tokens, 0 elsewhere; no gradient
    counts: dict[str, torch.Tensor]  # logged name -> scalar count of this micro-batch (Correction.counts)


class Correction:
    """An off-policy correction: subclass, declare `counts` (each count's logged name, e.g. 'is/trunc_frac', and
    what it counts, 'tokens' or 'sequences': the denominator of the logged fraction) and implement `__call__`."""

    name = "correction"
    counts: ClassVar[Mapping[str, Literal["tokens", "sequences"]]] = {}

    def __call__(self, logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> CorrectionOut:
        """logp [B,L] pi_old (detached), rollout_logp [B,L] the sampler's (0 off the mask), mask [B,L] 1 on
        sampled completion tokens -> the weights and this micro-batch's counts."""
        raise NotImplementedError


def _ratio(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho = pi_old / pi_rollout on the mask, 0 elsewhere (masked arithmetic: no data-dependent shapes, no sync)."""
    return torch.where(mask.bool(), torch.exp(logp - rollout_logp), 0.0)


class TruncatedIS(Correction):
    """w_t = min(rho_t, cap). Bit-identical to the trainer's TIS before corrections had a slot (loss.tis_cap)."""

    name = "tis"
    counts: ClassVar[Mapping[str, str]] = {"is/trunc_frac": "tokens"}  # tokens whose weight the cap truncated

    def __init__(self, cap: float = 2.0):
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"tis needs a cap > 0, got {cap}")
        self.cap = cap

    def __call__(self, logp, rollout_logp, mask) -> CorrectionOut:
        rho = _ratio(logp, rollout_logp, mask)
        weights = torch.clamp(torch.exp(logp - rollout_logp), max=self.cap) * mask
        return CorrectionOut(weights, {"is/trunc_frac": (rho > self.cap).sum()})


class _Band(Correction):
    """A correction with a band [low, high] that must hold 1 (an on-policy token, rho = 1, is never dropped)."""

    def __init__(self, low: float, high: float):
        if not (0.0 <= low <= 1.0 <= high and math.isfinite(high)):
            raise ValueError(f"{self.name} needs 0 <= low <= 1 <= high < inf, got low={low}, high={high}")
        self.low, self.high = low, high


class TokenMask(_Band):
    """w_t = 1 inside [low, high], 0 outside (prime-rl's token_mask_low/high, NeMo-RL's icepop without the IS
    weight). Defaults: prime-rl's 0.125 and 8."""

    name = "token_mask"
    counts: ClassVar[Mapping[str, str]] = {"is/masked_low_frac": "tokens", "is/masked_high_frac": "tokens"}

    def __init__(self, low: float = 0.125, high: float = 8.0):
        super().__init__(low, high)

    def __call__(self, logp, rollout_logp, mask) -> CorrectionOut:
        rho, m = _ratio(logp, rollout_logp, mask), mask.bool()
        below, above = m & (rho < self.low), m & (rho > self.high)
        weights = (m & ~below & ~above).to(logp.dtype)
        return CorrectionOut(weights, {"is/masked_low_frac": below.sum(), "is/masked_high_frac": above.sum()})


class SequenceGeoMask(_Band):
    """Every token of sequence i weighted 1 when its geometric-mean ratio exp(mean_t log rho_t) is inside
    [low, high], else 0 (prime-rl's geo_mask_low/high, SkyRL's sequence_mask_metric=geometric, verl's
    rollout_rs=geometric). Defaults 0.99 / 1.01: a 1% mean per-token disagreement."""

    name = "seq_geo_mask"
    counts: ClassVar[Mapping[str, str]] = {"is/masked_seqs_frac": "sequences", "is/masked_frac": "tokens"}

    def __init__(self, low: float = 0.99, high: float = 1.01):
        super().__init__(low, high)

    def __call__(self, logp, rollout_logp, mask) -> CorrectionOut:
        m = mask.bool()
        n = mask.sum(1)
        log_geo = torch.where(m, logp - rollout_logp, 0.0).sum(1) / n.clamp(min=1)
        geo = torch.exp(log_geo)
        outside = ((geo < self.low) | (geo > self.high)) & (n > 0)
        weights = (m & ~outside.unsqueeze(1)).to(logp.dtype)
        masked = (m & outside.unsqueeze(1)).sum()
        return CorrectionOut(weights, {"is/masked_seqs_frac": outside.sum(), "is/masked_frac": masked})


# name -> class, built with loss.correction_args as keyword arguments (loss.correction=none: no correction)
CORRECTIONS: dict[str, type[Correction]] = {c.name: c for c in (TruncatedIS, TokenMask, SequenceGeoMask)}
