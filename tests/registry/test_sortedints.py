"""SortedInts behaves as a sorted list of ints, across block splits and merges."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry import sortedints
from registry.sortedints import SortedInts


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-50, 50)), max_size=300))
def test_it_is_a_sorted_list(ops: list[tuple[bool, int]]) -> None:
    got, want = SortedInts(), list[int]()
    for add, value in ops:
        if add:
            got.add(value)
            bisect.insort(want, value)
        elif value in want:
            got.remove(value)
            want.remove(value)
        else:
            with pytest.raises(ValueError, match="not in"):
                got.remove(value)
    assert list(got) == want
    assert len(got) == len(want)
    for probe in (-60, -1, 0, 7, 60):
        assert got.bisect_left(probe) == bisect.bisect_left(want, probe)
    for k in range(len(want)):
        assert got[k] == want[k]
        assert list(got.islice(k)) == want[k:]


def test_blocks_split_and_empty_ones_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sortedints, "BLOCK", 4)
    s = SortedInts(range(20))
    for v in range(20, 40):
        s.add(v)
    assert list(s) == list(range(40))
    for v in range(40):
        s.remove(v)
    assert (len(s), list(s), bool(s)) == (0, [], False)
    with pytest.raises(IndexError):
        s[0]
