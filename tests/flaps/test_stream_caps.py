"""Per-caller caps on flaps' long calls (issue 27): each token may hold so many followed logs
and so many waits at once, whatever other tokens hold; and the caps' settings.

flaps runs in-process as flaps.main wires it when it checks tokens (servicers guarded by
flaps.auth, then wrapped by map_error), in front of the fake fleet of tests/flaps/support.py,
with `--streams-per-caller 1`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from flaps import auth, placement
from flaps.auth import REASON_DOMAIN, Authorizer, TokenVerifier
from flaps.errors import map_error
from flaps.service import Exchange, MachinesServicer, Workers
from flaps.settings import FlapsSettings
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from model.tokens import Keyring, new_key_line
from proxy.settings import ProxySettings
from registry.settings import ReplicaSettings
from runtime import Service, ServiceSettings, SettingsError, load_settings
from runtime.streams import STREAM_CAP
from tests.flaps.support import FakeFleet, fake_fleet
from tests.flyd.support import config
from tests.harness import channel
from tests.servicers import T, info_of, refused, seconds, serving

Machines = machines_pb2_grpc.MachinesServiceStub
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Flaps:
    address: str
    fleet: FakeFleet
    keyring: Keyring
    machines: MachinesServicer

    def stub(self) -> Machines:
        """A client with a token of its own (no caveats: it may do anything)."""
        return Machines(channel(self.address, token=self.keyring.mint(())))


@pytest.fixture
async def flaps(tmp_path: Path) -> AsyncIterator[Flaps]:
    async with fake_fleet(tmp_path, {"w1": "ams"}) as fleet:
        workers = Workers(fleet.replica)
        exchange = Exchange(fleet.replica, workers, placement.Pipeline())
        keyring = Keyring.parse(new_key_line("k1"))
        service = Service("flaps", ServiceSettings(grace_period=1))
        machines = MachinesServicer(exchange, streams_per_caller=1)
        descriptor = m.DESCRIPTOR.services_by_name["MachinesService"]
        auth.guard(
            machines, descriptor, Authorizer(TokenVerifier(lambda: keyring), exchange.app_of)
        )
        service.add(
            machines, machines_pb2_grpc.add_MachinesServiceServicer_to_server, descriptor, map_error
        )
        async with serving(service) as address:
            yield Flaps(address, fleet, keyring, machines)
        await workers.close()


async def a_machine(flaps: Flaps, stub: Machines) -> str:
    request = m.CreateMachineRequest(app="a", region="ams", config=config())
    machine = (await stub.CreateMachine(request, timeout=T)).machine
    await flaps.fleet.seen(machine.id)
    flaps.fleet.owner_of(machine.id).driver.write_log(machine.id, "hello")
    return machine.id


def refusal(err: grpc.aio.AioRpcError, kind: str) -> None:
    info = info_of(err)
    assert (info.reason, info.domain) == (STREAM_CAP, REASON_DOMAIN)
    assert info.metadata["kind"] == kind
    assert info.metadata["caller"].startswith("token ")
    assert "--streams-per-caller 1" in (err.details() or "")


async def test_each_token_follows_at_most_its_cap_of_logs(flaps: Flaps) -> None:
    one, two = flaps.stub(), flaps.stub()
    mid = await a_machine(flaps, one)
    follow = m.GetMachineLogsRequest(machine_id=mid, follow=True)
    first = one.GetMachineLogs(follow, timeout=T)
    others = two.GetMachineLogs(follow, timeout=T)
    try:
        assert (await first.read()).line == "hello"
        err = await refused(one.GetMachineLogs(follow, timeout=T).read(), EXHAUSTED)
        refusal(err, "GetMachineLogs follow streams")
        # Another token has a count of its own; a tail alone is not counted.
        assert (await others.read()).line == "hello"
        tail = m.GetMachineLogsRequest(machine_id=mid)
        assert [item.line async for item in one.GetMachineLogs(tail, timeout=T)] == ["hello"]
    finally:
        first.cancel()
        others.cancel()


async def test_each_token_waits_at_most_its_cap_at_once(flaps: Flaps) -> None:
    one, two = flaps.stub(), flaps.stub()
    mid = await a_machine(flaps, one)
    never = m.WaitMachineRequest(
        machine_id=mid, state=pb.MACHINE_STATE_DESTROYED, timeout=seconds(30)
    )
    waiting = asyncio.ensure_future(one.WaitMachine(never, timeout=T))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + T
        while not flaps.machines.streams.holding("WaitMachine calls"):
            assert loop.time() < deadline, "the first wait never arrived"
            await asyncio.sleep(0.005)
        err = await refused(one.WaitMachine(never, timeout=T), EXHAUSTED)
        refusal(err, "WaitMachine calls")
        started = m.WaitMachineRequest(machine_id=mid, state=pb.MACHINE_STATE_STARTED)
        assert (await two.WaitMachine(started, timeout=T)).machine.id == mid
    finally:
        waiting.cancel()


@pytest.mark.parametrize(
    ("settings", "streams", "follows"),
    [(FlapsSettings, 32, 64), (ProxySettings, None, 64)],
)
def test_the_caps_have_defaults_and_a_cap_of_none_is_refused_naming_it(
    settings: type[ReplicaSettings], streams: int | None, follows: int
) -> None:
    loaded = load_settings(settings, [], prog="x")
    assert getattr(loaded, "streams_per_caller", None) == streams
    assert loaded.follows_per_caller == follows  # registry Follow, served by each of them
    flags = ["--follows-per-caller"] + (["--streams-per-caller"] if streams else [])
    for flag in flags:
        field = flag.removeprefix("--").replace("-", "_")
        with pytest.raises(SettingsError, match=f"{field}: Input should be greater than 0"):
            load_settings(settings, [flag, "0"], prog="x")
