"""A real flyd's own limits (issue 27, item 6): it raises its descriptor limit at start as far
as the host allows, and the netd it starts has the same (it inherits flyd's)."""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

from flyd.drivers.netclient import NETD_HANDLE
from tests.harness import ServiceProcess


def nofile(pid: int) -> tuple[int, int]:
    """The soft and hard RLIMIT_NOFILE of a process, from /proc/<pid>/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


@contextlib.contextmanager
def soft_nofile(soft: int) -> Iterator[int]:
    """This process's soft limit lowered (its children start with it) while the block runs;
    yields the hard limit, which stays."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield before[1]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_flyd_and_its_netd_raise_their_descriptor_limit_to_the_hosts(
    flyd_factory: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    with soft_nofile(1024) as hard:
        flyd = flyd_factory()  # started with the common default of 1024
    assert flyd.proc is not None
    assert nofile(flyd.proc.pid) == (hard, hard)
    netd = tmp_path / "flyd-w1" / "machines" / NETD_HANDLE
    if netd.exists():  # the OCI driver: netd holds the machines' ports and connections
        assert nofile(json.loads(netd.read_text())["pid"]) == (hard, hard)
