"""The best checkpoint (`ckpt.keep_best`): small models often peak mid-run and then collapse, and keep-last
pruning would delete the peak. The run saves a checkpoint at every step where the chosen metric improves,
keep-last pruning never deletes it, and `checkpoints/best` names it beside `checkpoints/latest` (relative
symlinks, rewritten atomically at each save).

`ckpt.keep_best`: `auto` (the in-loop eval's main metric, `eval/accuracy`, higher is better, when `eval.every`
> 0; off otherwise), `none`, or `<metric>[:max|:min]`, any metric the run logs (`eval/pass@4`,
`rollout/reward_mean:max`, `eval/response_len_mean:min`). A step improves on the best only strictly (a tie keeps
the earlier step); a NaN or missing value never does. The best so far is part of the trainer state, so a
resumed run continues it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from rl_training.config.rules import parse_keep_best


@dataclass
class BestCheckpoint:
    metric: str  # '' = off
    mode: str = "max"
    step: int = 0  # 0 = none yet
    value: float | None = None

    @classmethod
    def from_config(cls, cfg, state: dict | None = None) -> BestCheckpoint:
        metric, mode = parse_keep_best(cfg.ckpt.keep_best, cfg.eval.every)
        state = state or {}
        if state.get("metric") != metric or state.get("mode") != mode:  # another choice than the saved run's
            state = {}
        return cls(metric, mode, int(state.get("step", 0)), state.get("value"))

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """True when `step`'s value of the metric beats the best so far (the step then needs a checkpoint)."""
        if not self.metric:
            return False
        v = metrics.get(self.metric)
        if v is None or not math.isfinite(v):
            return False
        if self.value is not None and not (v > self.value if self.mode == "max" else v < self.value):
            return False
        self.step, self.value = step, float(v)
        return True

    def state_dict(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "step": self.step, "value": self.value}

    @property
    def protected(self) -> int | None:
        """The step keep-last pruning must not delete."""
        return self.step if self.metric and self.step else None


def point(root: Path, name: str, target: str | None) -> None:
    """checkpoints/<name> -> target (a step directory's name), replaced atomically; removed when target is None."""
    link = root / name
    if target is None:
        if link.is_symlink():
            link.unlink()
        return
    tmp = root / f".link_{name}.new"  # not .tmp_*: the save sweeps those with rmtree
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
