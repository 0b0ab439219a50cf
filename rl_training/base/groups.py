"""The group: a step's sequences (rows) come group by group, one group per prompt, and `Groups` is the one place
that maps a group to its rows and a row to its group (issue 51, item 5). Group g holds rows [start(g), start(g) +
size(g)). Today every group of a step has rollout.group_size rows (`Groups.uniform`); the type does not assume it
(`size` is the one question that does, for the tensor math that views rows as [groups, size])."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Groups:
    sizes: tuple[int, ...]  # rows of each group, in row order

    def __post_init__(self):
        if not all(isinstance(s, int) and s > 0 for s in self.sizes):
            raise ValueError(f"group sizes must be positive integers, got {self.sizes}")

    @classmethod
    def uniform(cls, n_groups: int, size: int) -> Groups:
        """`n_groups` groups of `size` rows each."""
        return cls((size,) * n_groups)

    @classmethod
    def of_rows(cls, n_rows: int, size: int) -> Groups:
        """`n_rows` rows as groups of `size`: n_rows must be a whole number of groups."""
        if size <= 0 or n_rows % size:
            raise ValueError(f"{n_rows} rows are not whole groups of {size}")
        return cls.uniform(n_rows // size, size)

    def __len__(self) -> int:
        return len(self.sizes)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """The first row of each group."""
        return tuple(itertools.accumulate(self.sizes, initial=0))[:-1]

    @property
    def n_rows(self) -> int:
        return sum(self.sizes)

    @property
    def size(self) -> int:
        """The rows per group when every group has as many (what a [groups, size] view of per-row values needs)."""
        if len(set(self.sizes)) != 1:
            raise ValueError(f"groups of unequal sizes {sorted(set(self.sizes))} have no common size")
        return self.sizes[0]

    def rows(self, g: int) -> range:
        """The rows of group g."""
        return range(self.starts[g], self.starts[g] + self.sizes[g])

    def rows_of(self, groups: Iterable[int]) -> list[int]:
        """The rows of `groups`, group by group in that order."""
        return [r for g in groups for r in self.rows(g)]

    def group_of(self, row: int) -> int:
        """The group row `row` belongs to."""
        if not 0 <= row < self.n_rows:
            raise IndexError(f"row {row} of {self.n_rows}")
        return bisect.bisect_right(self.starts, row) - 1

    def place(self, row: int) -> tuple[int, int]:
        """(group, index within the group) of row `row`."""
        g = self.group_of(row)
        return g, row - self.starts[g]

    def split(self, per_row: Sequence) -> list:
        """Per-row values (one per row, in row order) as one slice per group."""
        if len(per_row) != self.n_rows:
            raise ValueError(f"{len(per_row)} values for {self.n_rows} rows")
        return [per_row[s : s + n] for s, n in zip(self.starts, self.sizes, strict=True)]

    def select(self, groups: Iterable[int]) -> Groups:
        """The groups `groups`, in that order, as groups of their own (the rows of `rows_of(groups)`)."""
        return Groups(tuple(self.sizes[g] for g in groups))
