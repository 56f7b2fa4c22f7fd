"""Sorted sequences kept in blocks, like sortedcontainers' SortedList: a list of sorted blocks
and the last entry of each, so an insert or a delete moves the entries of one block, never all
of them, and nothing ever copies the whole (as a list or dict that doubles does).

The base of `registry.sortedints.SortedInts` (blocks of machine ints) and
`registry.sortedkeys.SortedKeys` (blocks of strings); each says what a block is and how big it
grows (a block splits in two when it reaches twice its size).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, MutableSequence, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["SortedBlocks"]

K = TypeVar("K", int, str)


class SortedBlocks(Generic[K]):
    __slots__ = ("_blocks", "_len", "_maxes")

    def __init__(self, ordered: Sequence[K]) -> None:
        """`ordered`: the first entries, sorted."""
        size = self._size()
        self._blocks: list[MutableSequence[K]] = [
            self._block(ordered[i : i + size]) for i in range(0, len(ordered), size)
        ]
        self._maxes: list[K] = [b[-1] for b in self._blocks]
        self._len = len(ordered)

    def _size(self) -> int:
        raise NotImplementedError

    def _block(self, items: Sequence[K]) -> MutableSequence[K]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[K]:
        return itertools.chain.from_iterable(self._blocks)

    def _insert(self, value: K, *, unique: bool) -> None:
        blocks, maxes = self._blocks, self._maxes
        if not blocks:
            blocks.append(self._block([value]))
            maxes.append(value)
            self._len = 1
            return
        i = min(bisect.bisect_left(maxes, value), len(blocks) - 1)
        block: Any = blocks[i]
        j = bisect.bisect_left(block, value)
        if unique and j < len(block) and block[j] == value:
            return
        block.insert(j, value)
        self._len += 1
        maxes[i] = block[-1]
        size = self._size()
        if len(block) >= 2 * size:
            blocks[i : i + 1] = [block[:size], block[size:]]
            maxes[i : i + 1] = [block[size - 1], block[-1]]

    def _delete(self, value: K) -> bool:
        """Remove one `value`; False if there is none."""
        i = bisect.bisect_left(self._maxes, value)
        if i == len(self._blocks):
            return False
        block: Any = self._blocks[i]
        j = bisect.bisect_left(block, value)
        if j == len(block) or block[j] != value:
            return False
        del block[j]
        self._len -= 1
        if block:
            self._maxes[i] = block[-1]
        else:
            del self._blocks[i], self._maxes[i]
        return True
