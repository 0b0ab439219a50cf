"""Reward shaping by length: DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13).

With L_max the response budget and L_cache the buffer before it, a response of |y| tokens is penalised

    0                                  if |y| <= L_max - L_cache
    scale * (|y| - (L_max - L_cache)) / L_cache   if L_max - L_cache < |y| <= L_max

and the penalty is subtracted from the task's reward. DAPO gives -1 past L_max; a budget that stops generation at
L_max never produces such a response, so the cap is scale (a truncated response has |y| = L_max). Its companion,
overlong filtering (truncated responses masked out of the loss), is loss.overlong_filter (train/learner.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer: int, scale: float = 1.0) -> list[float]:
    """The penalty (>= 0, to subtract) of each response length; all 0 when buffer is 0 (off)."""
    if buffer <= 0:
        return [0.0] * len(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} exceeds the response budget {max_len}")
    start = max_len - buffer
    return [scale * min(max(n - start, 0), buffer) / buffer for n in lengths]
