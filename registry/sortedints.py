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
from collections.abc import Iterable, Iterator

__all__ = ["SortedInts"]

# Blocks split when they reach twice this, so an insert moves at most that many entries.
BLOCK = 1024


class SortedInts:
    __slots__ = ("_blocks", "_len", "_maxes")

    def __init__(self, items: Iterable[int] = ()) -> None:
        ordered = sorted(items)
        self._blocks = [array("q", ordered[i : i + BLOCK]) for i in range(0, len(ordered), BLOCK)]
        self._maxes = [b[-1] for b in self._blocks]
        self._len = len(ordered)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def add(self, value: int) -> None:
        blocks, maxes = self._blocks, self._maxes
        self._len += 1
        if not blocks:
            blocks.append(array("q", [value]))
            maxes.append(value)
            return
        i = min(bisect.bisect_left(maxes, value), len(blocks) - 1)
        block = blocks[i]
        bisect.insort(block, value)
        maxes[i] = block[-1]
        if len(block) >= 2 * BLOCK:
            blocks[i : i + 1] = [block[:BLOCK], block[BLOCK:]]
            maxes[i : i + 1] = [block[BLOCK - 1], block[-1]]

    def remove(self, value: int) -> None:
        """Remove one `value`; ValueError if there is none."""
        i = bisect.bisect_left(self._maxes, value)
        block = self._blocks[i] if i < len(self._blocks) else None
        j = -1 if block is None else bisect.bisect_left(block, value)
        if block is None or j == len(block) or block[j] != value:
            raise ValueError(f"{value} is not in the set")
        del block[j]
        self._len -= 1
        if block:
            self._maxes[i] = block[-1]
        else:
            del self._blocks[i], self._maxes[i]

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

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._blocks)

    def islice(self, start: int = 0) -> Iterator[int]:
        """The entries from position `start` on."""
        for block in self._blocks:
            if start < len(block):
                yield from itertools.islice(block, start, None)
                start = 0
            else:
                start -= len(block)
