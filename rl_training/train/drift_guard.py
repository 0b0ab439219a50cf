"""The length-drift guard: a run whose responses drift into never stopping while its held-out accuracy falls stops.

The failure it catches (seen on SmolLM2-135M-Instruct, docs/real_model.md): RL at too high a learning rate taught
the model to keep writing after its answer; the mean length climbed to the token cap, every completion was cut, and
the held-out accuracy fell to 0, while the training reward still rose (a partial-credit grader paid for the right
first letters whatever followed). Nothing else alerts on that: the canary, the skips and the probes all look fine.

Judged at every in-loop eval (eval.every > 0), all ranks agreeing (the eval metrics are the same on every rank): an
eval drifts when its accuracy (eval/accuracy, greedy) is at least eval.drift_accuracy_drop below the best eval so
far AND its greedy truncation rate (eval/truncation_rate) is at least eval.drift_truncation_rise above the lowest
rate of any eval so far. Either alone is a run's normal life (accuracy noise; a policy learning to reason longer).
The truncation baseline is the lowest rate, not the rate at the best eval: a drift can start before accuracy
falls (SmolLM2 at lr 1e-3: greedy accuracy 0.297, 0.359, 0.172 at steps 10, 20, 30 with truncation 0, 0.859, 1.0;
the best eval was already 86% cut, and measured from it the rise at step 30 was 0.14). The
first drifting eval raises eval/alert/length_drift; eval.drift_stop_evals in a row checkpoint and stop the run with
exit status DRIFT_EXIT_CODE (0 = only the alert). The state is checkpointed: a resume continues the streak.
"""

from __future__ import annotations

from rl_training.base.errors import UserError
from rl_training.base.exit_codes import DRIFT_EXIT_CODE

ALERT = "eval/alert/length_drift"


class DriftError(UserError, RuntimeError):
    """Held-out accuracy fell while responses ran into the token budget, eval.drift_stop_evals evals in a row."""

    exit_status = DRIFT_EXIT_CODE


class DriftGuard:
    def __init__(self, eval_cfg, state: dict | None = None):
        self.drop, self.rise = eval_cfg.drift_accuracy_drop, eval_cfg.drift_truncation_rise
        self.stop_evals = eval_cfg.drift_stop_evals
        state = state or {}
        self.best: tuple[int, float, float] | None = tuple(state["best"]) if state.get("best") else None
        self.history: list[tuple[int, float, float]] = [tuple(h) for h in state.get("history", [])]  # the streak
        # the lowest truncation rate of the evals so far (a checkpoint from before it was kept: the best eval's)
        self.low_trunc: float | None = state.get("low_trunc", self.best[2] if self.best else None)

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The guard's metrics for a step whose metrics hold an in-loop eval; {} for a step without one."""
        if "eval/accuracy" not in metrics:
            return {}
        acc, trunc = metrics["eval/accuracy"], metrics["eval/truncation_rate"]
        if self.best is None or acc > self.best[1]:
            self.best = (step, acc, trunc)
        self.low_trunc = trunc if self.low_trunc is None else min(self.low_trunc, trunc)
        drifting = acc <= self.best[1] - self.drop and trunc >= self.low_trunc + self.rise
        self.history = [*self.history, (step, acc, trunc)] if drifting else []
        return {ALERT: float(drifting), "eval/drift_streak": float(len(self.history))}

    def tripped(self) -> bool:
        return self.stop_evals > 0 and len(self.history) >= self.stop_evals

    def error(self, saved: str) -> DriftError:
        step, acc, trunc = self.best
        evals = "; ".join(f"step {s}: accuracy {a:.3f}, truncation {t:.3f}" for s, a, t in self.history)
        return DriftError(
            f"length drift: held-out accuracy fell while responses ran into the token budget ({evals}; the best eval, "
            f"step {step}: accuracy {acc:.3f}, truncation {trunc:.3f}; the lowest truncation {self.low_trunc:.3f}); "
            f"{saved}. The policy is learning to not stop: "
            "lower optim.lr, set loss.overlong_filter or reward.overlong_buffer, or check the grader's partial credit "
            "(docs/real_model.md). eval.drift_stop_evals=0 only alerts"
        )

    def state_dict(self) -> dict:
        best = list(self.best) if self.best else None
        return {"best": best, "history": [list(h) for h in self.history], "low_trunc": self.low_trunc}
