"""The group as a type (base/groups.py): one map between rows and groups, exact for groups of any sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_training.base.groups import Groups

sizes_st = st.lists(st.integers(1, 9), min_size=1, max_size=12).map(tuple)


@given(sizes_st)
def test_rows_and_groups_map_both_ways(sizes):
    groups = Groups(sizes)
    assert len(groups) == len(sizes) and groups.n_rows == sum(sizes)
    assert groups.rows_of(range(len(groups))) == list(range(groups.n_rows))  # every row once, in order
    for g in range(len(groups)):
        assert len(groups.rows(g)) == sizes[g]
        for i, r in enumerate(groups.rows(g)):
            assert groups.group_of(r) == g and groups.place(r) == (g, i)
    per_row = [f"r{r}" for r in range(groups.n_rows)]
    assert [x for part in groups.split(per_row) for x in part] == per_row
    assert [len(part) for part in groups.split(per_row)] == list(sizes)


@given(sizes_st, st.data())
def test_selected_groups_are_their_rows_renumbered(sizes, data):
    groups = Groups(sizes)
    chosen = data.draw(st.lists(st.integers(0, len(sizes) - 1), unique=True))
    sub = groups.select(chosen)
    rows = groups.rows_of(chosen)
    assert sub.sizes == tuple(sizes[g] for g in chosen) and sub.n_rows == len(rows)
    assert [rows[r] for r in sub.rows_of(range(len(sub)))] == rows


@given(st.integers(1, 8), st.integers(1, 8))
def test_equal_groups_are_the_old_arithmetic(n, size):
    # what the 9 sites computed before the type: group g is rows g*G .. g*G+G-1; row r is (r // G, r % G)
    groups = Groups.of_rows(n * size, size)
    assert groups == Groups.uniform(n, size) and groups.size == size
    assert groups.rows_of(range(n)) == [g * size + i for g in range(n) for i in range(size)]
    assert [groups.place(r) for r in range(n * size)] == [(r // size, r % size) for r in range(n * size)]
    assert list(groups.starts) == list(range(0, n * size, size))


def test_what_the_type_refuses():
    with pytest.raises(ValueError, match="7 rows are not whole groups of 2"):
        Groups.of_rows(7, 2)
    with pytest.raises(ValueError, match="positive integers"):
        Groups((2, 0))
    with pytest.raises(ValueError, match=r"unequal sizes \[1, 3\] have no common size"):
        _ = Groups((1, 3, 1)).size
    with pytest.raises(IndexError):
        Groups((2, 2)).group_of(4)
    with pytest.raises(ValueError, match="3 values for 4 rows"):
        Groups((2, 2)).split([1, 2, 3])
