"""Per-step metrics of multi-turn episodes (rollout/episodes.py): a Part of the step (base/parts.py); none for
single-turn.

rollout/turns_mean, truncated_tokens_rate / truncated_turns_rate (the two budgets), obs_tokens_mean, obs_capped
(observations cut at multiturn.max_obs_tokens), trainable_tokens_mean, env_errors / env_invalid (episodes the
environment ended by raising, or by a Step the engine could not use: rollout/episodes.py); the environment's own
from its episode counts (Environment.episode_metrics: a search task's searches_mean, valid_action_rate,
answer_rate) and from its per-call stats (a search task's retrieval/*: queries, failed, retries summed; batch
latency p50/p95 the slowest rank's); rollout/logp_diff_turn<t> (mean |trainer - sampler| log-prob over turn t's
sampled tokens, epoch 0), the per-turn canary.
"""

from __future__ import annotations

from rl_training.base.parts import Part
from rl_training.rollout.base import Rollouts
from rl_training.rollout.episodes import ERROR_KINDS
from rl_training.train.update import MAX_TURNS


def episode_part(rollouts: Rollouts, turn_logp_diff: dict[int, tuple[float, float]], env) -> Part | None:
    """The episodes' Part (base/parts.py) when the task is multi-turn, None for single-turn (every rank runs the
    same task, so every rank returns a Part or none)."""
    if rollouts.episodes is None:
        return None
    eps = rollouts.episodes
    turns = _turns(turn_logp_diff)
    sums = {
        "n": len(eps),
        "turns": sum(e["turns"] for e in eps),
        **{k: sum(e[k] for e in eps) for k in env.episode_counts},
        "trunc_tokens": sum(e["truncated"] == "tokens" for e in eps),
        "trunc_turns": sum(e["truncated"] == "turns" for e in eps),
        "obs_tokens": sum(e["obs_tokens"] for e in eps),
        "obs_capped": sum(e["obs_capped"] for e in eps),
        **{k: sum(e.get("error", "").startswith(k + ":") for e in eps) for k in ERROR_KINDS},
        "trainable": sum(rollouts.trainable(i) for i in range(len(rollouts))),
        **{f"gap{t}": g for t, (g, _) in turns.items()},
        **{f"tok{t}": n for t, (_, n) in turns.items()},
    }
    maxes: dict[str, float] = {}
    if rollouts.env_stats is not None:  # the environment's per-call stats: summed, or the slowest rank's
        values = rollouts.env_stats.metrics()
        maxed = set(getattr(rollouts.env_stats, "max_keys", ()))
        sums.update({STAT + k: v for k, v in values.items() if k not in maxed})
        maxes.update({STAT + k: v for k, v in values.items() if k in maxed})

    def finish(sums: dict, maxes: dict, logged: dict) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        out = {
            "rollout/turns_mean": sums["turns"] / n,
            **env.episode_metrics(sums),
            "rollout/truncated_tokens_rate": sums["trunc_tokens"] / n,
            "rollout/truncated_turns_rate": sums["trunc_turns"] / n,
            "rollout/obs_tokens_mean": sums["obs_tokens"] / n,
            "rollout/obs_capped": sums["obs_capped"],
            "rollout/trainable_tokens_mean": sums["trainable"] / n,
            "rollout/env_errors": sums["env_error"],
            "rollout/env_invalid": sums["env_invalid"],
        }
        for t in turns:
            if sums[f"tok{t}"] > 0:
                out[f"rollout/logp_diff_turn{t}"] = sums[f"gap{t}"] / sums[f"tok{t}"]
        out.update({k[len(STAT) :]: v for k, v in {**sums, **maxes}.items() if k.startswith(STAT)})
        return out

    return Part(sums, maxes, finish)


STAT = "stat:"  # the prefix of the environment's call stats among the Part's sums and maxes


def _turns(turn_logp_diff: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Every turn up to MAX_TURNS, zeros where this rank had none: the same keys on every rank (a collective
    over differently keyed dicts would not line up)."""
    return {t: turn_logp_diff.get(t, (0.0, 0.0)) for t in range(1, MAX_TURNS + 1)}
