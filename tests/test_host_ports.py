"""The tests' host ports (`tests/host_ports.py`): one window per xdist worker, none shared, none
the kernel's, and no test that picks its ports anywhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import host_ports
from tests.host_ports import BLOCK, HIGH, LOW, Blocks, window

TESTS = Path(__file__).resolve().parent


def ephemeral_start() -> int:
    low, _high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_the_windows_of_the_workers_are_apart_and_below_the_kernels_ports(count: int) -> None:
    windows = [window(i, count) for i in range(count)]
    seen: set[int] = set()
    for ports in windows:
        assert ports.start >= LOW
        assert ports.stop <= HIGH
        assert not seen & set(ports)
        seen |= set(ports)
    assert ephemeral_start() >= HIGH


def test_two_workers_split_the_range_in_halves() -> None:
    assert (window(0, 2), window(1, 2)) == (range(20500, 26500), range(26500, 32500))


@pytest.mark.parametrize(
    ("index", "count", "says"),
    [(2, 2, "worker 2 of 2"), (0, 100, "run fewer")],
)
def test_a_worker_without_a_window_is_refused(index: int, count: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        window(index, count)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, (1, 2)),
        ({"PYTEST_XDIST_WORKER": "master"}, (0, 1)),
    ],
)
def test_the_worker_is_read_from_xdists_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: tuple[int, int]
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_ports.worker() == expected


def test_blocks_follow_each_other_and_start_over_when_the_next_does_not_fit() -> None:
    blocks = Blocks(range(1000, 1250))
    assert [blocks.block(100), blocks.block(100)] == [range(1000, 1100), range(1100, 1200)]
    assert blocks.block(100) == range(1000, 1100)  # 1200-1299 would leave the window
    with pytest.raises(ValueError, match="does not fit"):
        blocks.block(251)


def test_a_block_is_of_this_workers_window_and_flyd_reads_it_as_a_range() -> None:
    ports = host_ports.block()
    assert len(ports) == BLOCK
    assert set(ports) <= set(window(*host_ports.worker()))
    assert host_ports.flag(range(21000, 21050)) == "21000-21049"


# What a test would write to pick host ports of its own: flyd's `--ports "LOW-HIGH"`, a literal
# `--base-port`, or a literal range handed to a real driver's `hold_ports`. (The fakes' ports,
# `tests/flyd/support.py`'s PORTS, are numbers a FakeHost keeps: nothing binds them.)
CHOSEN_HERE = re.compile(
    r"""["']\d{4,5}-\d{4,5}["']"""
    r"""|["']--base-port["'],\s*["']\d+["']"""
    r"""|hold_ports\([^)]*range\(\d"""
)


def test_every_test_takes_its_host_ports_from_host_ports() -> None:
    chosen = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        for found in CHOSEN_HERE.finditer(text):
            line = text.count("\n", 0, found.start()) + 1
            chosen.append(f"{path.relative_to(TESTS)}:{line}: {found.group(0)}")
    assert chosen == []
