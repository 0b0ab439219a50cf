"""Progress on rank 0: a tqdm bar on a terminal; in a log file (SLURM, nohup) one plain line every N seconds.

A bar's carriage-return updates turn a log into one unreadable line, so without a terminal each report is a
whole line: step of total, the reward and step time of the latest step, and the ETA from the median step time
of the steps since the last report:

    [rl] step 120/200 (60%)  reward 0.812  step 0.46 s  ETA 0m37s
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import TextIO


def _duration(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LineProgress:
    """One line every `every_s` seconds (and at the last step) to `stream`."""

    def __init__(self, total: int, initial: int, every_s: float, desc: str = "rl", stream: TextIO | None = None):
        self.total, self.step, self.every_s, self.desc = total, initial, every_s, desc
        self.stream = stream or sys.stderr
        self._last_print = time.monotonic()
        self._times: list[float] = []

    def update(self, step: int, step_s: float, **values: float) -> None:
        self.step = step
        self._times.append(step_s)
        now = time.monotonic()
        if now - self._last_print < self.every_s and step < self.total:
            return
        self._last_print = now
        med = statistics.median(self._times[-50:])
        shown = "  ".join(f"{k} {v:.4g}" for k, v in values.items())
        line = (
            f"[{self.desc}] step {step}/{self.total} ({step / self.total:.0%})  {shown}  "
            f"step {med:.3g} s  ETA {_duration(med * (self.total - step))}"
        )
        print(line, file=self.stream, flush=True)

    def close(self) -> None: ...


class BarProgress:
    """tqdm on a terminal."""

    def __init__(self, total: int, initial: int, desc: str = "rl"):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, step: int, step_s: float, **values: float) -> None:
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()})
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class NullProgress:
    def update(self, step: int, step_s: float, **values: float) -> None: ...

    def close(self) -> None: ...


def make_progress(total: int, initial: int, enabled: bool, every_s: float, desc: str = "rl", stream=None):
    """The bar on a terminal, lines in a log file, nothing off rank 0 or when disabled."""
    if not enabled:
        return NullProgress()
    stream = stream or sys.stderr
    if stream.isatty():
        return BarProgress(total, initial, desc)
    return LineProgress(total, initial, every_s, desc, stream)
