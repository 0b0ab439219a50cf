"""Wall-clock seconds per named phase of a step (a leaf: the runners and the eval library both time with it)."""

import time
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
