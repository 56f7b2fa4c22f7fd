"""A sorted set of strings in blocks, for the view's machine ids: a page of an app's machines in
id order is found in O(log n) and read in O(page), and adding an id moves one block, not all.

Blocks of strings (`registry.sortedblocks`): no block grows past `2 * BLOCK` keys, so no
insert, delete or resize holds the loop however many machines an app has.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, MutableSequence, Sequence

from registry.sortedblocks import SortedBlocks

__all__ = ["SortedKeys"]

# Blocks split when they reach twice this.
BLOCK = 512


class SortedKeys(SortedBlocks[str]):
    __slots__ = ()

    def __init__(self, keys: Iterable[str] = ()) -> None:
        super().__init__(sorted(set(keys)))

    def _size(self) -> int:
        return BLOCK

    def _block(self, items: Sequence[str]) -> MutableSequence[str]:
        return list(items)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        i = bisect.bisect_left(self._maxes, key)
        if i == len(self._blocks):
            return False
        block = self._blocks[i]
        j = bisect.bisect_left(block, key)
        return j < len(block) and block[j] == key

    def add(self, key: str) -> None:
        """Add `key` (nothing if it is there)."""
        self._insert(key, unique=True)

    def discard(self, key: str) -> None:
        """Remove `key` if it is there."""
        self._delete(key)

    def after(self, key: str) -> Iterator[str]:
        """The keys greater than `key`, in order ("": all of them)."""
        i = bisect.bisect_right(self._maxes, key)
        if i == len(self._blocks):
            return
        first = self._blocks[i]
        yield from itertools.islice(first, bisect.bisect_right(first, key), None)
        for block in itertools.islice(self._blocks, i + 1, None):
            yield from block
