"""Host ports that tests hand out: every pytest-xdist worker draws from a window of its own.

A test chooses host ports itself wherever the product takes a range: flyd's `--ports` (its
machines' published ports), a driver's `hold_ports` candidates, `nonomad up --base-port`. Two
tests running at once (`make test` runs two xdist workers) must never choose the same port: a
machine that lets its published port go while it starts (the process driver's) would find it
taken by another test's machine. So every such port comes from `block()`, and nowhere else.

The layout, on the host's port numbers:

- below `LOW`: a `make up` cluster's machines (`nonomad up`: `--base-port` 20000, 100 ports for
  each of its first five workers), which a developer may run beside the tests;
- `LOW`..`HIGH`: the tests', cut into one window per xdist worker (`PYTEST_XDIST_WORKER` `gwN`
  of `PYTEST_XDIST_WORKER_COUNT`; one window of all of it without xdist): with two workers gw0
  has 20500-26499 and gw1 26500-32499;
- from 32768: the kernel's ephemeral ports (`/proc/sys/net/ipv4/ip_local_port_range`), which
  every `--listen 127.0.0.1:0` and every outgoing connection takes: never a test's choice.

Within its window a worker hands out blocks one after another and starts over at the window's
start when the next does not fit: by then the tests that held the first blocks are long over (a
block is held by one test, or one module's fixture; a window holds 120 blocks of 50).
"""

from __future__ import annotations

import os
import re

LOW = 20500
HIGH = 32500
"""The tests' ports are LOW <= port < HIGH."""
BLOCK = 50
"""A flyd's range unless it needs another size."""


def worker() -> tuple[int, int]:
    """(this process's xdist worker index, how many workers there are); (0, 1) without xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", name)
    if match is None:
        return 0, 1
    return int(match.group(1)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def window(index: int, count: int) -> range:
    """The ports worker `index` of `count` hands out: an equal share of LOW..HIGH."""
    if not 0 <= index < count:
        raise ValueError(f"worker {index} of {count}")
    size = (HIGH - LOW) // count
    if size < 10 * BLOCK:
        raise ValueError(f"{count} workers leave {size} ports each: run fewer (-n)")
    return range(LOW + index * size, LOW + (index + 1) * size)


class Blocks:
    """Consecutive blocks of one window, starting over at its start when one does not fit."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self._next = ports.start

    def block(self, size: int = BLOCK) -> range:
        if not 0 < size <= len(self.ports):
            raise ValueError(f"a block of {size} ports does not fit in {self.ports}")
        if self._next + size > self.ports.stop:
            self._next = self.ports.start
        start, self._next = self._next, self._next + size
        return range(start, start + size)


_blocks = Blocks(window(*worker()))


def block(size: int = BLOCK) -> range:
    """`size` host ports of this worker's window that no other test running now holds."""
    return _blocks.block(size)


def flag(ports: range) -> str:
    """`ports` as flyd's `--ports` takes them: "LOW-HIGH", both included."""
    return f"{ports.start}-{ports.stop - 1}"
