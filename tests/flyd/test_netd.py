"""netd (flyd.drivers.netd) and flyd's side of it (flyd.drivers.netclient), on a netd of the
test's own: requests whose callers are cancelled mid-way (issue 27, attack 12).

Real netd processes (skipped, with the reason, where crun cannot run: netd needs the same
namespaces); traffic only to 127.0.0.1. Nothing waits on wall-clock time.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flyd.drivers.netclient import Netd, kill_netd
from tests.flyd.driver_support import OCI_UNAVAILABLE
from tests.flyd.support import cancel_at_step

pytestmark = pytest.mark.skipif(
    OCI_UNAVAILABLE is not None, reason=f"netd cannot run here: {OCI_UNAVAILABLE}"
)


@pytest.fixture
async def netd(tmp_path: Path) -> AsyncIterator[Netd]:
    run_root = tmp_path / "run"
    run_root.mkdir()
    net = Netd(run_root)
    net.connect()
    yield net
    net.close()
    kill_netd(run_root)


async def test_a_request_cancelled_at_any_point_leaves_the_next_one_its_own_answer(
    netd: Netd,
) -> None:
    """A caller whose deadline passes mid-request used to leave netd's answer in the socket,
    read by the next request as its own (an `up` answered `{}`, then a namespace path
    another machine's `down` had closed)."""
    k = 1
    while await cancel_at_step(netd.request("hello"), k):
        assert await netd.request("down", machine="nobody") == {}
        assert (await netd.request("hello"))["pid"] == netd.pid
        k += 1
    assert k > 1  # it was cancelled at least once


async def test_ports_handed_over_by_a_cancelled_request_still_reach_netd(netd: Netd) -> None:
    """The request copies the sockets it sends at once: the caller closes its own whether or
    not it is still there to hear the answer, and netd holds the port all the same."""
    k = 1
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            request = netd.request("publish", [s.fileno()], machine=f"m{k}", ports=[[port, 80]])
            cancelled = await cancel_at_step(request, k)
        held = (await netd.request("hello"))["machines"]
        assert held[f"m{k}"]["ports"] == [port]
        assert await netd.request("forget", machine=f"m{k}") == {}
        if not cancelled:
            break
        k += 1
    assert k > 1
