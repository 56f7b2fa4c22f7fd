"""A sorted multiset of 64-bit ints kept in blocks of `array('q')`, for the supply's index.

Like sortedcontainers' SortedList (a list of sorted blocks, so an insert moves one block, not
the whole), but each block is an array of machine ints instead of a list of int objects: 8
bytes an entry instead of about 36, and nothing the garbage collector walks (an array holds no
references), which matters when the index holds a few hundred thousand entries and a full
collection would otherwise visit each one.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Iterable, Iterator, MutableSequence, Sequence

from registry.sortedblocks import SortedBlocks

__all__ = ["SortedInts"]

# Blocks split when they reach twice this, so an insert moves at most that many entries.
BLOCK = 1024


class SortedInts(SortedBlocks[int]):
    __slots__ = ()

    def __init__(self, items: Iterable[int] = ()) -> None:
        super().__init__(sorted(items))

    def _size(self) -> int:
        return BLOCK

    def _block(self, items: Sequence[int]) -> MutableSequence[int]:
        return array("q", items)

    def add(self, value: int) -> None:
        self._insert(value, unique=False)

    def remove(self, value: int) -> None:
        """Remove one `value`; ValueError if there is none."""
        if not self._delete(value):
            raise ValueError(f"{value} is not in the set")

    def bisect_left(self, value: int) -> int:
        """How many entries are below `value`."""
        i = bisect.bisect_left(self._maxes, value)
        if i == len(self._blocks):
            return self._len
        return sum(len(b) for b in self._blocks[:i]) + bisect.bisect_left(self._blocks[i], value)

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self._len:
            raise IndexError(index)
        for block in self._blocks:
            if index < len(block):
                return block[index]
            index -= len(block)
        raise AssertionError("unreachable")

    def islice(self, start: int = 0) -> Iterator[int]:
        """The entries from position `start` on."""
        for block in self._blocks:
            if start < len(block):
                yield from itertools.islice(block, start, None)
                start = 0
            else:
                start -= len(block)
