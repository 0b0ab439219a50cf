"""Per-step metrics of multi-turn episodes (rollout/episodes.py), reduced across ranks; {} for single-turn.

rollout/turns_mean, searches_mean, valid_action_rate (turns that searched or answered / all turns), answer_rate,
truncated_tokens_rate / truncated_turns_rate (the two budgets), obs_tokens_mean, obs_capped (observations cut
at multiturn.max_obs_tokens), trainable_tokens_mean; retrieval/* (queries, failed, retries, batch latency
p50/p95: the slowest rank's); rollout/logp_diff_turn<t> (mean |trainer - sampler| log-prob over turn t's
sampled tokens, epoch 0), the per-turn canary.
"""

from __future__ import annotations

from rl_training import dist
from rl_training.rollout.base import Rollouts


def episode_metrics(rollouts: Rollouts, turn_logp_diff: dict[int, tuple[float, float]], device) -> dict[str, float]:
    """Collective on every rank when the task is multi-turn (all ranks run the same task)."""
    if rollouts.episodes is None:
        return {}
    eps = rollouts.episodes
    turns = sum(e["turns"] for e in eps)
    sums = dist.reduce_sums(
        {
            "n": len(eps),
            "turns": turns,
            "searches": sum(e["searches"] for e in eps),
            "valid": turns - sum(e["invalid"] for e in eps),
            "answered": sum(e["answered"] for e in eps),
            "trunc_tokens": sum(e["truncated"] == "tokens" for e in eps),
            "trunc_turns": sum(e["truncated"] == "turns" for e in eps),
            "obs_tokens": sum(e["obs_tokens"] for e in eps),
            "obs_capped": sum(e["obs_capped"] for e in eps),
            "trainable": sum(rollouts.trainable(i) for i in range(len(rollouts))),
            **{f"gap{t}": g for t, (g, _) in _turns(turn_logp_diff).items()},
            **{f"tok{t}": n for t, (_, n) in _turns(turn_logp_diff).items()},
        },
        device,
    )
    n = max(sums["n"], 1.0)
    out = {
        "rollout/turns_mean": sums["turns"] / n,
        "rollout/searches_mean": sums["searches"] / n,
        "rollout/valid_action_rate": sums["valid"] / max(sums["turns"], 1.0),
        "rollout/answer_rate": sums["answered"] / n,
        "rollout/truncated_tokens_rate": sums["trunc_tokens"] / n,
        "rollout/truncated_turns_rate": sums["trunc_turns"] / n,
        "rollout/obs_tokens_mean": sums["obs_tokens"] / n,
        "rollout/obs_capped": sums["obs_capped"],
        "rollout/trainable_tokens_mean": sums["trainable"] / n,
    }
    for t in _turns(turn_logp_diff):
        if sums[f"tok{t}"] > 0:
            out[f"rollout/logp_diff_turn{t}"] = sums[f"gap{t}"] / sums[f"tok{t}"]
    if rollouts.retrieval is not None:
        r = rollouts.retrieval.metrics()
        counts = dist.reduce_sums(
            {k: r[k] for k in ("retrieval/queries", "retrieval/failed", "retrieval/retries")}, device
        )
        lat = dist.reduce_max({k: r[k] for k in ("retrieval/latency_p50_ms", "retrieval/latency_p95_ms")}, device)
        out.update(counts)
        out.update(lat)
    return out


def _turns(turn_logp_diff: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Every turn up to MAX_TURNS, zeros where this rank had none: the same keys on every rank (a collective
    over differently keyed dicts would not line up)."""
    from rl_training.trainer import MAX_TURNS

    return {t: turn_logp_diff.get(t, (0.0, 0.0)) for t in range(1, MAX_TURNS + 1)}
