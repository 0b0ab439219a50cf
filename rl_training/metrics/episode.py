"""Per-step metrics of multi-turn episodes (rollout/episodes.py) into the step's meter (base/meter.py); none for
single-turn.

rollout/turns_mean, truncated_tokens_rate / truncated_turns_rate (the two budgets), obs_tokens_mean, obs_capped
(observations cut at multiturn.max_obs_tokens), trainable_tokens_mean, env_errors / env_invalid (episodes the
environment ended by raising, or by a Step the engine could not use: rollout/episodes.py); the environment's own
from its episode counts (Environment.episode_metrics: a search task's searches_mean, valid_action_rate,
answer_rate) and from its per-call stats (Environment.call_stats: a search task's retrieval/*). The per-turn canary
(rollout/logp_diff_turn<t>) is the canary's (train/canary.py).
"""

from __future__ import annotations

from rl_training.base.meter import Meter
from rl_training.rollout.base import Rollouts


def measure_episodes(meter: Meter, rollouts: Rollouts, env) -> None:
    """The episodes' metrics when the task is multi-turn, nothing for single-turn (every rank runs the same task,
    so every rank meters the same names)."""
    if rollouts.episodes is None:
        return
    eps = rollouts.episodes
    n = len(eps)
    sums = {"n": n, "turns": sum(e["turns"] for e in eps), "obs_tokens": sum(e["obs_tokens"] for e in eps)}
    sums |= {k: sum(e[k] for e in eps) for k in env.episode_counts}
    meter.mean("rollout/turns_mean", sums["turns"], per=n)
    meter.mean("rollout/truncated_tokens_rate", sum(e["truncated"] == "tokens" for e in eps), per=n)
    meter.mean("rollout/truncated_turns_rate", sum(e["truncated"] == "turns" for e in eps), per=n)
    meter.mean("rollout/obs_tokens_mean", sums["obs_tokens"], per=n)
    meter.add("rollout/obs_capped", sum(e["obs_capped"] for e in eps))
    meter.mean("rollout/trainable_tokens_mean", sum(rollouts.trainable(i) for i in range(len(rollouts))), per=n)
    meter.add("rollout/env_errors", sum(e.get("error", "").startswith("env_error:") for e in eps))
    meter.add("rollout/env_invalid", sum(e.get("error", "").startswith("env_invalid:") for e in eps))
    # the environment's own metrics from the global sums of its episode counts (Environment.episode_metrics)
    for k, v in sums.items():
        meter.add(EPISODE + k, v, log=False)
    meter.then(lambda logged, totals: env.episode_metrics({k: totals[EPISODE + k] for k in sums}))
    if rollouts.env_stats is not None:  # the environment's per-call stats (Environment.call_stats)
        rollouts.env_stats.measure(meter)


EPISODE = "episode/"  # the environment's episode sums, metered unlogged for its episode_metrics
