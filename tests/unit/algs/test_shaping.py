"""DAPO's soft overlong punishment (algs/shaping.py), value by value."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_training.algs.shaping import overlong_penalty


def test_the_penalty_is_zero_before_the_buffer_then_linear_to_the_budget():
    # L_max 16, L_cache 4: free up to 12 tokens, then (|y| - 12) / 4: 13 -> 0.25, 14 -> 0.5, 16 -> 1 (DAPO eq. 13)
    assert overlong_penalty([0, 5, 12, 13, 14, 16], 16, 4) == [0, 0, 0, 0.25, 0.5, 1.0]
    assert overlong_penalty([14, 16], 16, 4, scale=0.5) == [0.25, 0.5]
    assert overlong_penalty([3, 16], 16, 0) == [0.0, 0.0]  # off
    assert overlong_penalty([20], 16, 16) == [1.0]  # capped at the budget's penalty
    with pytest.raises(ValueError, match="overlong buffer 17 exceeds the response budget 16"):
        overlong_penalty([1], 16, 17)


@given(st.lists(st.integers(0, 64), max_size=20), st.integers(1, 64), st.floats(0, 4))
def test_the_penalty_is_bounded_and_never_falls_with_length(lengths, buffer, scale):
    pen = overlong_penalty(sorted(lengths), 64, buffer, scale)
    assert all(0 <= p <= scale for p in pen)
    assert pen == sorted(pen)
