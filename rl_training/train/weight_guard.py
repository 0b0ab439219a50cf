"""The weight-state guard: a run whose rollouts were not sampled from the trained weights stops.

Rollouts from the wrong weights (a skipped or broken sync, base weights after a sleep, a stale adapter, a
server serving another version) are the silent failure RL trainers are known for: the loss still falls and the
reward may still rise for a while. Two signals judge it every step, both agreed by all ranks:

- the canary, `rollout/logp_diff_mean`: the mean |trainer - sampler| log-prob of the sampled tokens (already
  all-reduced). Healthy, it is kernel round-off; from other weights it grows with how far they are from the
  trained ones. It counts against the weights when above `rollout.canary_max_logp_diff` (0 = by
  `model.dtype`, DEFAULT_MAX_LOGP_DIFF) on `rollout.canary_stop_steps` steps in a row. It is judged only where
  it measures the weights alone: synchronous rollouts (rollout.max_async_level=0; with K > 0 every batch comes
  from a policy K updates old, so the canary includes that drift by design), rollout.top_p=1 (below it the
  sampler's log-probs are renormalised over the nucleus) and rollout.min_new_tokens=0 (above it the sampler
  masks the stop tokens, a distribution the trainer does not score).
- the policy version of every completion (`Rollouts.policy_version`: every built-in backend fills it, issue 41
  item 3; the colocated engine and the servers from the weight-version tag set where the weights were loaded,
  HF from the trainer's own count): a batch of step t must come from versions in [t - K, t]. Anything else is
  a bookkeeping failure with no round-off to allow for: the run stops at that step. This is exact where the
  canary is statistical (a sync that loads nothing leaves the old tag); the canary still catches what no tag
  sees (a tag set over the wrong weights, a server whose adapter files are stale).

On a trip the runner checkpoints the step, then raises WeightStateError (exit status WEIGHT_STATE_EXIT_CODE)
with one message naming what to check for the layout. rollout.canary_stop_steps=0 logs without stopping.
"""

from __future__ import annotations

import math

from rl_training.base.errors import UserError
from rl_training.base.exit_codes import WEIGHT_STATE_EXIT_CODE
from rl_training.base.meter import Meter

# Per model.dtype, for every backend (hf, vllm, server): the largest healthy rollout/logp_diff_mean, with a
# wide margin. What they were set from (scripts/bench_canary.py prints the table; docs/rollout.md keeps it):
# float32, healthy, after a sync: vLLM (CPU) ~1e-6, HF ~1e-7, a server ~1e-6; a sync skipped for one step at
# lr 1e-2 on the tiny model: ~1e-2 and growing. bfloat16: the GPU tests hold healthy steps of the tiny model
# to < 2e-2 (tests/integration/test_gpu.py); 5e-2 leaves 2.5x, to be revised with the H100's measurements.
DEFAULT_MAX_LOGP_DIFF = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


# how far the batch's oldest policy version lies behind its step, and its newest ahead (maxed over ranks, unlogged)
LAG_LOW, LAG_HIGH = "guard/version_lag_low", "guard/version_lag_high"


class WeightStateError(UserError, RuntimeError):
    """The rollouts were not sampled from the trained weights (the canary or the policy version says so)."""

    exit_status = WEIGHT_STATE_EXIT_CODE


def max_logp_diff(cfg) -> float:
    return cfg.rollout.canary_max_logp_diff or DEFAULT_MAX_LOGP_DIFF[cfg.model.dtype]


class WeightGuard:
    """Judges each step's canary and policy versions; its counts are checkpointed (a resume continues them)."""

    def __init__(self, cfg, state: dict | None = None, advice: str = "the weight sync after each step"):
        self.cfg = cfg
        self.advice = advice  # what to check on a trip: the backend's own (rollout/kinds.py canary_advice)
        self.max_diff = max_logp_diff(cfg)
        self.stop_steps = cfg.rollout.canary_stop_steps
        self.k = cfg.rollout.max_async_level
        self.judges_canary = self.k == 0 and cfg.rollout.top_p >= 1 and cfg.rollout.min_new_tokens == 0
        state = state or {}
        self.streak = int(state.get("streak", 0))  # consecutive steps over the threshold
        self.over_steps = int(state.get("over_steps", 0))  # all steps over it, for the metric
        self.recent: list[float] = list(state.get("recent", []))  # the streak's canary values, for the message
        self.bad_version = ""  # set on the step a policy version falls outside [t - K, t]

    def measure(self, meter: Meter, step: int, policy_versions: list[int] | None) -> None:
        """Batch `step` (0-based) judged from the step's meter (base/meter.py): the versions that sampled it are
        maxed over ranks, the canary is the step's rollout/logp_diff_mean (metered by the update; absent when no
        rank trained a token: then the canary streak is left as it was, neither reset nor extended); after the
        reduction the guard updates and logs the guard/* metrics."""
        lo, hi = (min(policy_versions), max(policy_versions)) if policy_versions else (step, step)
        meter.max(LAG_LOW, float(step - lo), log=False)
        meter.max(LAG_HIGH, float(hi - step), log=False)
        meter.then(
            lambda logged, totals: self._judge(
                step, {"low": totals[LAG_LOW], "high": totals[LAG_HIGH]}, logged.get("rollout/logp_diff_mean")
            )
        )

    def _judge(self, step: int, flags: dict[str, float], canary: float | None) -> dict[str, float]:
        if flags["low"] > self.k or flags["high"] > 0:
            oldest, newest = step - int(flags["low"]), step + int(flags["high"])
            self.bad_version = (
                f"batch {step + 1} was sampled by policy versions {oldest}..{newest}, outside "
                f"[{max(0, step - self.k)}, {step}] (rollout.max_async_level={self.k})"
            )
        if canary is None:  # nothing was measured: no evidence either way
            pass
        elif self.judges_canary and not (canary <= self.max_diff):  # a NaN canary counts too
            self.streak += 1
            self.over_steps += 1
            self.recent = [*self.recent, canary][-self.stop_steps or None :]
        else:
            self.streak, self.recent = 0, []
        return {
            "guard/canary_over_steps": float(self.over_steps),
            "guard/canary_streak": float(self.streak),
            "guard/canary_max": self.max_diff,
        }

    def tripped(self) -> bool:
        return self.stop_steps > 0 and (bool(self.bad_version) or self.streak >= self.stop_steps)

    def error(self, step: int, saved: str) -> WeightStateError:
        """The one-line reason to stop after step `step` (1-based), `saved` naming the checkpoint written."""
        cfg = self.cfg
        if self.bad_version:
            what = self.bad_version
        else:
            values = ", ".join(f"{v:.3g}" if math.isfinite(v) else str(v) for v in self.recent)
            what = (
                f"steps {step - self.streak + 1}-{step}: the trainer-vs-sampler canary rollout/logp_diff_mean was "
                f"{values}, above {self.max_diff:g} (model.dtype={cfg.model.dtype}, rollout.backend="
                f"{cfg.rollout.backend}; rollout.canary_max_logp_diff) {self.streak} steps in a row"
            )
        return WeightStateError(
            f"{what}: the rollouts were not sampled from the trained weights; {saved}. Check {self.advice}. "
            "Then resume with ckpt.resume=latest (rollout.canary_stop_steps=0 only logs)"
        )

    def state_dict(self) -> dict:
        return {"streak": self.streak, "over_steps": self.over_steps, "recent": self.recent}
