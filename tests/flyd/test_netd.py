"""netd (flyd.drivers.netd) and flyd's side of it (flyd.drivers.netclient), on a netd of the
test's own: requests whose callers are cancelled mid-way (issue 27, attack 12), and the
descriptors netd spends on each machine.

Real netd processes (skipped, with the reason, where crun cannot run: netd needs the same
namespaces); traffic only to 127.0.0.1. Nothing waits on wall-clock time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from flyd.drivers.base import PortMapping
from flyd.drivers.netclient import Netd, kill_netd
from flyd.drivers.oci import OciDriver
from model.errors import InvalidArgument, Unavailable
from tests import host_ports
from tests.flyd.driver_support import (
    DEADLINE,
    OCI_UNAVAILABLE,
    Exits,
    answers_http,
    netd_hello,
    run_machine,
    sh,
    spec,
    wait_until,
)
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


# -- descriptors: netd's limit, each machine's budget ------------------------------------------

HOLDER = """\
import socket
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 8080))
listener.listen(4096)
print("holding", flush=True)
held = []
while True:
    held.append(listener.accept())
"""
FLOOD = 600  # more than half the default descriptor limit (1024): two each in netd
BUDGET = 8


@pytest.fixture
def kind() -> str:
    """Only the OCI driver here (tests/flyd/conftest.py's `make_driver` builds what this says)."""
    return "oci"


def _limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files limit")


async def test_a_flood_on_one_machine_leaves_netd_s_descriptors_to_the_others(
    make_driver: Callable[..., Any], image: Path, run_root: Path
) -> None:
    """netd runs with the descriptor limit the host allows, not the default 1024, and
    forwards at most BUDGET connections into one machine at once: a flood of FLOOD held
    connections on one machine's port is reset beyond that, and counted, while another
    machine keeps answering on its own port all along."""
    exits = Exits()
    driver = make_driver(exits, connections_per_machine=BUDGET)
    netd_pid = json.loads((run_root / ".netd.json").read_text())["pid"]
    soft, _ = _limits(netd_pid)
    assert soft > 1024
    hello = netd_hello(run_root)
    assert hello["limits"] == {"nofile": soft, "connections_per_machine": BUDGET}
    ports = {}
    for mid, script in (("flooded", ["python3", "-c", HOLDER]), ("other", sh(SERVE))):
        (port,) = driver.hold_ports(mid, host_ports.block(100), 1)
        ports[mid] = port
        await driver.publish(mid, (PortMapping(port, 8080),))
        await run_machine(driver, spec(mid, script, image, ports=(PortMapping(port, 8080),)))
    await wait_until(lambda: answers_http(ports["other"]), "the other machine to serve")
    await wait_until(lambda: _accepts(ports["flooded"]), "the flooded machine to listen")
    # The probe's connection stays half-open in netd: the holder never closes its side.
    probed = netd_hello(run_root)["machines"]["flooded"]["connections"]
    forwarded = BUDGET - probed

    flood: list[socket.socket] = []
    try:
        for i in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", ports["flooded"]), timeout=5))
            if i % 100 == 99:  # the other machine answers during the flood
                assert await asyncio.to_thread(answers_http, ports["other"])

        def over_budget() -> bool:
            seen = netd_hello(run_root)["machines"]
            return seen["flooded"]["refused"] >= FLOOD - forwarded

        await wait_until(over_budget, "netd to reset the connections over the budget")
        seen = netd_hello(run_root)["machines"]
        assert seen["flooded"]["connections"] == BUDGET
        assert seen["other"]["refused"] == 0
        assert await asyncio.to_thread(answers_http, ports["other"])
        assert seen["flooded"]["refused"] == FLOOD - forwarded
        # The ones over the budget were reset; the rest reach the machine, which holds them.
        reset = sum(1 for conn in flood if _was_reset(conn))
        assert reset == FLOOD - forwarded
    finally:
        for conn in flood:
            conn.close()
    for mid in ports:
        await driver.stop(mid, signal.SIGTERM, DEADLINE)
    await wait_until(  # the machine gone, what it held ends in netd
        lambda: netd_hello(run_root)["machines"]["flooded"]["connections"] == 0,
        "the flood's connections to end in netd",
    )


SERVE = "exec python3 -m http.server 8080 --bind 127.0.0.1"


def _accepts(port: int) -> bool:
    """A connection to `port` is forwarded (not reset at once) and stays open."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.settimeout(0.2)
            try:
                return conn.recv(1) != b""
            except TimeoutError:
                return True  # held open: the machine has it
    except OSError:
        return False


def _was_reset(conn: socket.socket) -> bool:
    conn.settimeout(0)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False  # open, nothing to read: forwarded to the machine, which holds it


HALF_CLOSER = """\
import socket
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 8080))
listener.listen()
print("serving", flush=True)
held = []
while True:
    conn, _ = listener.accept()
    while conn.recv(4096):
        pass
    conn.shutdown(socket.SHUT_WR)  # says it sends no more, and keeps the socket
    held.append(conn)
"""


async def test_a_connection_both_sides_have_half_closed_is_let_go_of(
    make_driver: Callable[..., Any], image: Path, run_root: Path
) -> None:
    """Once the client and the machine have each said they send no more, netd closes the
    pair: it used to keep both descriptors until someone closed a socket outright, which a
    machine need never do (a leak of netd's descriptors at the machine's will)."""
    exits = Exits()
    driver = make_driver(exits)
    (port,) = driver.hold_ports("m1", host_ports.block(100), 1)
    published = (PortMapping(port, 8080),)
    await driver.publish("m1", published)
    await run_machine(driver, spec("m1", ["python3", "-c", HALF_CLOSER], image, ports=published))
    await wait_until(lambda: _accepts(port), "the machine to serve")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as conn:
            conn.sendall(b"bytes")
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(1) == b""  # the machine's end of the stream, through netd
    await wait_until(
        lambda: netd_hello(run_root)["machines"]["m1"]["connections"] == 0,
        "netd to let go of the connections",
    )
    await driver.stop("m1", signal.SIGTERM, DEADLINE)


@pytest.mark.parametrize("bad", [0, -1, "8", True, None])
async def test_a_bad_connection_budget_is_refused_and_changes_nothing(
    netd: Netd, bad: object
) -> None:
    before = (await netd.request("hello"))["limits"]
    with pytest.raises(Unavailable, match="connections_per_machine"):
        await netd.request("limits", connections_per_machine=bad)
    assert (await netd.request("hello"))["limits"] == before


def test_a_driver_refuses_a_connection_budget_below_one(run_root: Path, prefix: str) -> None:
    with pytest.raises(InvalidArgument, match="connections_per_machine"):
        OciDriver(run_root, on_exit=Exits(), cgroup_prefix=prefix, connections_per_machine=0)
    assert not (run_root / ".netd.sock").exists()  # nothing started
