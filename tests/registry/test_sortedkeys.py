"""SortedKeys behaves as a sorted set of strings, across block splits; `after` pages it."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry import sortedkeys
from registry.sortedkeys import SortedKeys

KEYS = st.text(alphabet="abc", max_size=4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), KEYS), max_size=300), st.lists(KEYS, max_size=5))
def test_it_is_a_sorted_set(ops: list[tuple[bool, str]], probes: list[str]) -> None:
    got, want = SortedKeys(), set[str]()
    for add, key in ops:
        if add:
            got.add(key)
            want.add(key)
        else:
            got.discard(key)
            want.discard(key)
    ordered = sorted(want)
    assert list(got) == ordered
    assert len(got) == len(want)
    assert bool(got) == bool(want)
    for probe in ["", *probes]:
        assert list(got.after(probe)) == ordered[bisect.bisect_right(ordered, probe) :]
        assert (probe in got) == (probe in want)


def test_blocks_split_and_empty_ones_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sortedkeys, "BLOCK", 2)
    keys = SortedKeys()
    for i in range(20):
        keys.add(f"k{i:02d}")
    assert len(keys._blocks) > 1
    assert all(len(b) < 4 for b in keys._blocks)
    for i in range(0, 20, 2):
        keys.discard(f"k{i:02d}")
    assert list(keys.after("k10")) == [f"k{i:02d}" for i in range(11, 20, 2)]
    for i in range(1, 20, 2):
        keys.discard(f"k{i:02d}")
    assert (list(keys), keys._blocks, len(keys)) == ([], [], 0)
