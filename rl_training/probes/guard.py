"""The probes observe training and must never stop it: an exception in probe code is counted and reported once.

`ProbeGuard` wraps each piece of probe code that runs on one rank (never a collective): an exception there is
counted (`probe/failures`, summed over ranks), the first one is printed with its rank, where it happened and
the traceback's last line, and the step's probe readings are marked failed on every rank (the flag travels in
the next all-reduce, so all ranks agree to skip the GNS update). The collectives themselves run
unconditionally, with payloads of a fixed size built under the guard (NaN when that failed), so a failure on
one rank cannot leave the others waiting in a collective it skipped (docs/probes.md 5).
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager


def last_line(exc: BaseException) -> str:
    """'Type: message (file:line in function)' of the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return traceback.format_exception_only(type(exc), exc)[-1].strip() + where


class ProbeGuard:
    def __init__(self) -> None:
        self.failures = 0  # this rank's, since the start of the run (restored on resume)
        self.step_failed = False  # this rank, this step
        self.reported = False

    def record(self, where: str, exc: BaseException) -> None:
        self.failures += 1
        self.step_failed = True
        if not self.reported:
            self.reported = True
            rank = os.environ.get("RANK", "0")
            print(
                f"[rank {rank}] probe failure in {where}, training continues (counted in probe/failures, "
                f"reported once): {last_line(exc)}",
                flush=True,
            )

    @contextmanager
    def __call__(self, where: str):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - the probes observe training; a probe bug must not stop it
            self.record(where, e)
