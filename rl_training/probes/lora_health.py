"""LoRA health: the singular values of every adapter update and a rank-collapse alert (docs/probes.md 8).

A LoRA module adds Delta W = s B A (s = alpha/r, peft's `scaling`; B [out, r], A [r, in]). Its r singular values
come cheaply from QR factors: B = Q_B R_B and A^T = Q_A R_A give B A = Q_B (R_B R_A^T) Q_A^T, and Q_B, Q_A have
orthonormal columns, so sigma(B A) = sigma(R_B R_A^T), an r x r SVD. Cost per module about 2 (out + in) r^2
FLOPs, never the out x in product. Modules of one shape go through one batched QR and one batched SVD; the
spectra reach the host in one transfer. Everything below `spectra` is plain arithmetic on host floats.

The collapse rule is a heuristic (no published threshold exists): see COLLAPSE_STABLE_RANK.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

BANDS = ("early", "middle", "late")
# A module is "collapsed" when its stable rank sum(s^2)/s_max^2 is below this: more than 1/1.2 = 83% of the
# update's energy lies in one direction. The alert needs a majority of the modules collapsed (one module can
# legitimately learn a rank-1 edit) and r >= 4 (with r < 4 there is no room to tell collapse from the rank).
COLLAPSE_STABLE_RANK = 1.2
COLLAPSE_FRACTION = 0.5
COLLAPSE_MIN_RANK = 4
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraFactors:
    """One adapted module's update factors, as peft holds them."""

    name: str  # the module's qualified name, e.g. base_model.model.model.layers.3.self_attn.q_proj
    a: torch.Tensor  # [r, in]  lora_A.weight
    b: torch.Tensor  # [out, r] lora_B.weight
    scaling: float  # alpha / r (alpha / sqrt(r) with rsLoRA)


def lora_factors(model) -> list[LoraFactors]:
    """The active adapters' factors of every LoRA linear in a peft model (weights only; no copy). With DoRA the
    applied update also rescales columns by a learned magnitude; the spectrum is then that of s B A alone."""
    from peft.tuners.lora import LoraLayer

    out = []
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            for adapter in m.active_adapters:
                if adapter in m.lora_A:
                    a, b = m.lora_A[adapter].weight.detach(), m.lora_B[adapter].weight.detach()
                    out.append(LoraFactors(name, a, b, float(m.scaling[adapter])))
    return out


def spectra(factors: list[LoraFactors]) -> list[list[float]]:
    """Singular values (descending) of s B A for each module, via batched QR of B and A^T and an r x r SVD."""
    by_shape: dict[tuple, list[int]] = {}
    for i, f in enumerate(factors):
        by_shape.setdefault((tuple(f.a.shape), tuple(f.b.shape), f.a.device), []).append(i)
    order, parts = [], []
    for idx in by_shape.values():
        dt = torch.promote_types(factors[idx[0]].a.dtype, torch.float32)  # no QR in bf16/fp16
        b = torch.stack([factors[i].b for i in idx]).to(dt)  # [n, out, r]
        at = torch.stack([factors[i].a.T for i in idx]).to(dt)  # [n, in, r]
        r_b = torch.linalg.qr(b, mode="r").R
        r_a = torch.linalg.qr(at, mode="r").R
        s = torch.linalg.svdvals(r_b @ r_a.transpose(1, 2))  # [n, r]
        scale = torch.tensor([abs(factors[i].scaling) for i in idx], dtype=s.dtype, device=s.device)
        parts.append((s * scale[:, None]).double().reshape(-1))
        order.append((idx, s.shape[1]))
    flat = torch.cat(parts).cpu().tolist() if parts else []  # the one device-to-host transfer
    out: list[list[float]] = [[] for _ in factors]
    pos = 0
    for idx, r in order:
        for i in idx:
            out[i] = flat[pos : pos + r]
            pos += r
    return out


def stable_rank(sigma: list[float]) -> float:
    """sum s_i^2 / s_max^2 in [1, r]; NaN for a zero update (peft's B = 0 at initialisation)."""
    top = max(sigma, default=0.0)
    return sum(s * s for s in sigma) / (top * top) if top > 0 else math.nan


def entropy_rank(sigma: list[float]) -> float:
    """Roy & Vetterli's effective rank exp(H(p)), p_i = s_i / sum s, in [1, r]; NaN for a zero update."""
    total = sum(sigma)
    if not total > 0:
        return math.nan
    return math.exp(-sum(p * math.log(p) for p in (s / total for s in sigma) if p > 0))


def module_type_and_band(name: str, n_layers: int) -> tuple[str, str]:
    """('q_proj', 'early') for '...layers.3.self_attn.q_proj' of a model with n_layers; band 'other' when the
    name has no layer index. Bands are thirds of the layer indices: 3 l // n -> early, middle, late."""
    kind = name.rsplit(".", 1)[-1]
    m = _LAYER.search(name + ".")
    if m is None or n_layers <= 0:
        return kind, "other"
    return kind, BANDS[min(3 * int(m.group(1)) // n_layers, 2)]


def collapse_alert(stable_ranks: list[float], r: int) -> bool:
    """Rank collapse: r >= COLLAPSE_MIN_RANK and more than COLLAPSE_FRACTION of the modules with a non-zero
    update have stable rank < COLLAPSE_STABLE_RANK. Zero updates (NaN) neither count nor alert."""
    defined = [x for x in stable_ranks if not math.isnan(x)]
    if r < COLLAPSE_MIN_RANK or not defined:
        return False
    return sum(x < COLLAPSE_STABLE_RANK for x in defined) > COLLAPSE_FRACTION * len(defined)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def health_metrics(names: list[str], sigmas: list[list[float]], n_layers: int) -> dict[str, float]:
    """The lora/* metrics from each module's spectrum: per (type, band) means of the stable rank, the entropy
    rank and the update's Frobenius norm; overall minima and medians; the collapse alert."""
    groups: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for name, s in zip(names, sigmas, strict=True):
        row = (stable_rank(s), entropy_rank(s), math.sqrt(sum(x * x for x in s)))
        groups.setdefault(module_type_and_band(name, n_layers), []).append(row)
    out: dict[str, float] = {}
    for (kind, band), rows in sorted(groups.items()):
        for j, key in enumerate(("stable_rank", "entropy_rank", "update_norm")):
            out[f"lora/{key}/{kind}/{band}"] = _mean([row[j] for row in rows])
    sr = [stable_rank(s) for s in sigmas]
    er = [entropy_rank(s) for s in sigmas]
    defined = sorted(x for x in sr if not math.isnan(x))
    r = max((len(s) for s in sigmas), default=0)
    out["lora/stable_rank/min"] = defined[0] if defined else math.nan
    out["lora/stable_rank/median"] = defined[len(defined) // 2] if defined else math.nan
    out["lora/entropy_rank/min"] = min((x for x in er if not math.isnan(x)), default=math.nan)
    out["lora/collapsed_frac"] = sum(x < COLLAPSE_STABLE_RANK for x in defined) / len(defined) if defined else 0.0
    out["lora/rank"] = float(r)
    out["lora/alert/rank_collapse"] = float(collapse_alert(sr, r))
    return out


def lora_health_due(every: int, step: int) -> bool:
    """Whether the trainer computes LoRA health after update `step` (0-based; logged at step + 1): on every
    `every`-th logged step, the adapter after `every`, 2 `every`, ... updates; `every` = 0: never."""
    return every > 0 and (step + 1) % every == 0


def lora_health(model) -> dict[str, float]:
    """The lora/* metrics of a peft model's active adapters (keys lora/stable_rank/<type>/<band>, ...).
    Reads weights only: no gradient, no forward; rank-local (every rank holds the same adapter)."""
    factors = lora_factors(model)
    if not factors:
        raise ValueError("lora_health: the model has no LoRA layers")
    config = getattr(model, "config", None)
    n_layers = getattr(config, "num_hidden_layers", 0) or 0
    if not n_layers:  # no config: the largest layer index seen + 1
        idx = [int(m.group(1)) for f in factors if (m := _LAYER.search(f.name + "."))]
        n_layers = max(idx) + 1 if idx else 0
    return health_metrics([f.name for f in factors], spectra(factors), n_layers)


def spectra_flops(shapes: list[tuple[int, int, int]]) -> float:
    """FLOPs of `spectra` for modules of (out, in, r): Householder QR (R only) of an m x r matrix costs
    2 m r^2 - (2/3) r^3, done for B (m = out) and A^T (m = in); the r x r product 2 r^3; the singular values
    of an r x r matrix (bidiagonalisation, 4 n^3 - 4/3 n^3 at m = n; the bidiagonal QR sweeps are O(r^2))
    (8/3) r^3."""
    total = 0.0
    for out_f, in_f, r in shapes:
        total += 2 * (out_f + in_f) * r * r - 2 * (2 / 3) * r**3 + 2 * r**3 + (8 / 3) * r**3
    return total
