"""TensorBoard custom-scalar layout for the probes (one tab, rows as in docs/probes.md 4) and alerts.

The alert rules (docs/probes.md 4) are heuristics: the token ESS of the trainer/rollout mismatch
(the smaller of ess/token on the weights used and ess/token_raw on the raw ratios, so it fires without TIS too)
< 0.95 warn, < 0.8 critical, or a drop of more than 3 sd (floor 0.005) below its recent steps;
a NaN or +inf weight reads 0 (critical); noise-dominated when the whole B_simple band lies above the batch and
B/B_simple < 0.25, compute-wasteful when it lies below and B/B_simple > 4 (batch_alert);
the GNS invalid for longer than its EMA window; trSigma at two levels disagreeing by more than [0.7, 1.4]
while the SE is below 0.15.
"""

from __future__ import annotations

import math
import re

# TensorBoard's Custom Scalars tab colours by run, not by series: the series of one chart are told apart only by
# their marker (circle, square, triangle, ...), and every Multiline entry is a regex. So each chart holds at most
# three series that share a scale, and custom_scalar_layout() anchors every tag (an unanchored
# 'probe/gns/b_simple' also matched _lo, _hi, _rel_se and the three @level tags: 13 series in one colour).
LAYOUT = {
    "1 GNS: batch vs noise scale": {
        "B_simple with +-2 SE band (prompt groups)": [
            "Margin",
            ["probe/gns/b_simple", "probe/gns/b_simple_lo", "probe/gns/b_simple_hi"],
        ],
        "B_simple and its efficient zone [B_s/2, 2 B_s]": [
            "Margin",
            ["probe/gns/b_simple", "probe/gns/zone_lo", "probe/gns/zone_hi"],
        ],
        "batch, recommended batch, goodput-optimal B*": [
            "Multiline",
            ["probe/gns/batch_units", "probe/gns/recommended_batch", "probe/gns/b_star"],
        ],
    },
    "2 GNS: |G|^2 and tr(Sigma)": {
        "|G|^2 (EMA, raw)": ["Multiline", ["probe/gns/grad_sq_norm_est", "probe/gns/grad_sq_norm_raw"]],
        "tr(Sigma) per group (EMA, raw)": ["Multiline", ["probe/gns/trace_sigma_est", "probe/gns/trace_sigma_raw"]],
    },
    "3 GNS: efficiency and trust": {
        "step and sample efficiency": ["Multiline", ["probe/gns/step_efficiency", "probe/gns/sample_efficiency"]],
        "B / B_simple": ["Multiline", ["probe/gns/batch_ratio"]],
        "valid (0/1) and relative SE of B_simple": ["Multiline", ["probe/gns/valid", "probe/gns/b_simple_rel_se"]],
        "effective steps in the EMA (N_eff)": ["Multiline", ["probe/gns/n_eff"]],
    },
    "4 GNS: consistency across levels": {
        "tr(Sigma) at unit / micro / rank": [
            "Multiline",
            ["probe/gns/trace_sigma_est@unit", "probe/gns/trace_sigma_est@micro", "probe/gns/trace_sigma_est@rank"],
        ],
        "B_simple at unit / micro / rank": [
            "Multiline",
            ["probe/gns/b_simple@unit", "probe/gns/b_simple@micro", "probe/gns/b_simple@rank"],
        ],
    },
    "5 Off-policy health": {
        "token ESS: weights used, raw ratios (warn < 0.95, critical < 0.8)": [
            "Multiline",
            ["probe/ess/token", "probe/ess/token_raw"],
        ],
        "sequence ESS, PPO-ratio ESS": ["Multiline", ["probe/ess/seq", "probe/ess/ppo_token"]],
        "IS ratio max, p99.9, mean": ["Multiline", ["is/ratio_max", "is/ratio_p99_9", "is/ratio_mean"]],
        # a regex: whichever counts the run's loss.correction logs (is/trunc_frac for tis, is/masked_*_frac, ...)
        "off-policy correction: fraction truncated or masked": ["Multiline", [r"is/\w+_frac"]],
        "mismatch KL (k1, k3) and chi2": ["Multiline", ["is/kl_k1", "is/kl_k3", "is/chi2_token"]],
        "trainer vs rollout log-prob gap (mean, max)": [
            "Multiline",
            ["rollout/logp_diff_mean", "rollout/logp_diff_max"],
        ],
    },
    "6 Signal concentration": {
        "advantage ESS (sequence, token)": ["Multiline", ["probe/ess/adv_seq", "probe/ess/adv_token"]],
        "degenerate (zero-advantage) groups": ["Multiline", ["probe/gns/degenerate_group_frac"]],
        "PPO clip fraction": ["Multiline", ["train/clip_frac"]],
        "response length (mean, max)": ["Multiline", ["rollout/response_len_mean", "rollout/response_len_max"]],
    },
    "7 Alerts (0 = ok)": {
        "token ESS (1 warn, 2 critical); batch (-1 noisy, +1 wasteful)": [
            "Multiline",
            ["probe/alert/ess_token", "probe/alert/batch"],
        ],
        "GNS invalid; levels disagree": ["Multiline", ["probe/alert/gns_invalid", "probe/alert/levels_disagree"]],
        "LoRA rank collapse; rollout split far from the advice": [
            "Multiline",
            ["lora/alert/rank_collapse", "probe/alert/rollout_split"],
        ],
    },
    # every probe.lora_health_every steps (docs/probes.md 8); per module type and layer band: lora/*/<type>/<band>
    "8 LoRA health": {
        "stable rank: min and median over modules": ["Multiline", ["lora/stable_rank/min", "lora/stable_rank/median"]],
        "entropy rank (min over modules) and the LoRA rank r": ["Multiline", ["lora/entropy_rank/min", "lora/rank"]],
        "fraction of modules collapsed (stable rank < 1.2)": ["Multiline", ["lora/collapsed_frac"]],
    },
    # probe.advisor: every probe.unit_every steps (docs/probes.md 9-10)
    "9 Rollout budget: completions per prompt": {
        "K* with its +-2 SE band": ["Margin", ["probe/advisor/k_star", "probe/advisor/k_lo", "probe/advisor/k_hi"]],
        "current K, K* without waste": ["Multiline", ["probe/advisor/k_current", "probe/advisor/k_star_no_waste"]],
        "between- and within-prompt noise tr S_b, tr S_w (EMA)": [
            "Multiline",
            ["probe/anova/trace_between", "probe/anova/trace_within"],
        ],
        "tr S_w / tr S_b with its +-2 SE band": [
            "Margin",
            ["probe/anova/within_between_ratio", "probe/anova/ratio_lo", "probe/anova/ratio_hi"],
        ],
        "efficiency of the current split f(K*)/f(K); trusted": [
            "Multiline",
            ["probe/advisor/efficiency", "probe/advisor/trusted"],
        ],
        "critical rollouts per step; prompts per step B*": [
            "Multiline",
            ["probe/advisor/critical_rollouts", "probe/advisor/b_star"],
        ],
    },
    # probe.forecast_from: with each in-loop eval from that step on (docs/probes.md 11)
    "10 Forecast: the final held-out reward": {
        "forecast final reward with its 80% band": [
            "Margin",
            ["probe/forecast/final_reward", "probe/forecast/final_reward_lo", "probe/forecast/final_reward_hi"],
        ],
        "held-out reward now; the fitted asymptote": ["Multiline", ["eval/reward_mean", "probe/forecast/asymptote"]],
    },
}


def custom_scalar_layout(layout: dict = LAYOUT) -> dict:
    """The layout as TensorBoard takes it: Multiline tags become anchored, escaped regexes (Margin takes tags)."""
    return {
        category: {
            title: [kind, [f"^{re.escape(t)}$" for t in tags] if kind == "Multiline" else list(tags)]
            for title, (kind, tags) in charts.items()
        }
        for category, charts in layout.items()
    }


ESS_WARN, ESS_CRITICAL = 0.95, 0.8
DROP_SD, DROP_FLOOR, DROP_MIN_HISTORY = 3.0, 0.005, 10
NOISE_RATIO, WASTE_RATIO = 0.25, 4.0  # B/B_simple outside [1/4, 4]: the batch alert


def mismatch_ess(m: dict[str, float]) -> float:
    """The token ESS the ess_token alert watches: without TIS the weights used are all 1 (ess/token = 1), so
    the raw ratios are what show a trainer/rollout disagreement."""
    return min(m.get("probe/ess/token", 1.0), m.get("probe/ess/token_raw", 1.0))


def batch_alert(batch: float, ratio: float, lo: float, hi: float) -> float:
    """-1 noise-dominated: the whole B_simple band lies above the batch (B < lo: one-sided error <= 2.3%) and
    the point estimate puts the batch below B_simple/4 (a ratio of NaN with a band means |G|^2_ema <= 0: all
    noise). +1 compute-wasteful: B > hi and the batch is above 4 B_simple. Never during the band's warm-up
    (lo, hi NaN). docs/probes.md 4 gives the rates measured at B/B_simple = 0.04, 0.2, 1 and 5."""
    if batch < lo and not ratio >= NOISE_RATIO:
        return -1.0
    if batch > hi and ratio > WASTE_RATIO:
        return 1.0
    return 0.0


def alerts(m: dict[str, float], invalid_streak: int, ess_history: list[float] = ()) -> dict[str, float]:
    """0 = fine. ess_token: 1 warn (or a sudden drop) / 2 critical. batch: -1 noise-dominated, +1 wasteful.
    `ess_history`: mismatch_ess of the previous steps (the drop rule needs DROP_MIN_HISTORY of them).
    A step whose token ESS is undefined (`probe/ess/defined` = 0) raises no ess_token alert."""
    out = {
        "probe/alert/ess_token": 0.0,
        "probe/alert/batch": 0.0,
        "probe/alert/gns_invalid": 0.0,
        "probe/alert/levels_disagree": 0.0,
    }
    tok = mismatch_ess(m)
    drop = False
    if len(ess_history) >= DROP_MIN_HISTORY:
        mu = sum(ess_history) / len(ess_history)
        sd = math.sqrt(sum((x - mu) ** 2 for x in ess_history) / (len(ess_history) - 1))
        drop = mu - tok > max(DROP_SD * sd, DROP_FLOOR)
    if not m.get("probe/ess/defined", 1.0):
        pass  # no token was weighted (every group dropped for a zero advantage): nothing to alert on
    elif tok < ESS_CRITICAL:
        out["probe/alert/ess_token"] = 2.0
    elif tok < ESS_WARN or drop:
        out["probe/alert/ess_token"] = 1.0
    out["probe/alert/batch"] = batch_alert(
        m.get("probe/gns/batch_units", math.nan),
        m.get("probe/gns/batch_ratio", math.nan),
        m.get("probe/gns/b_simple_lo", math.nan),
        m.get("probe/gns/b_simple_hi", math.nan),
    )
    if invalid_streak > m.get("probe/gns/n_eff", math.inf):
        out["probe/alert/gns_invalid"] = 1.0
    levels = [
        m[k]
        for k in ("probe/gns/trace_sigma_est@unit", "probe/gns/trace_sigma_est@micro", "probe/gns/trace_sigma_est@rank")
        if k in m and m[k] > 0
    ]
    se = m.get("probe/gns/b_simple_rel_se", math.nan)
    if len(levels) >= 2 and se < 0.15 and not 0.7 <= max(levels) / min(levels) <= 1.4:
        out["probe/alert/levels_disagree"] = 1.0
    return out


ALERT_TEXT = {
    "probe/alert/ess_token": "token ESS of the importance weights is low or dropped suddenly: trainer and rollout "
    "policies disagree "
    "(check is/ratio_max, rollout/logp_diff_*; set or tighten loss.correction)",
    "probe/alert/batch": "batch is far from B_simple: below 1/4 = noise-dominated (bigger batch or lower lr), "
    "above 4x = compute-wasteful (smaller batch)",
    "probe/alert/gns_invalid": "|G|^2 estimate non-positive for longer than the EMA window: B_simple undefined "
    "(batch far below the noise scale; raise gns_ema_beta or the batch)",
    "probe/alert/levels_disagree": "tr(Sigma) differs across unit/micro/rank levels: correlated units "
    "(duplicate prompts, split groups) or a loss-scaling bug",
    "probe/alert/rollout_split": "the current completions per prompt K costs >= 1.25x the gradient variance x "
    "compute of the advisor's K*, outside its +-2 SE band, with a trusted estimate: read probe/advisor/k_star and "
    "b_star (docs/probes.md 10)",
    "eval/alert/length_drift": "held-out accuracy fell while the greedy truncation rate rose (eval.drift_*): the "
    "policy is learning not to stop; the run stops after eval.drift_stop_evals such evals (train/drift_guard.py)",
    "lora/alert/rank_collapse": "most adapted modules put over 83% of their update in one direction (stable rank "
    "< 1.2): LoRA rank collapse; read the trend of lora/stable_rank/* and lora/update_norm/* (docs/probes.md 8)",
}
