"""RegistryService over gRPC in-process, the error mapping, and the standalone settings."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from registry.errors import InvalidArgument, RegistryError, SequenceGap, Unavailable
from registry.fakes import FakeWorker
from registry.replica import Replica
from registry.service import RegistryServicer, map_error
from registry.settings import RegistrySettings
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from registry.view import ALIVE, DEAD
from runtime import SettingsError, aio_channel, load_settings
from runtime.clock import ManualClock
from tests.registry.support import eventually, running, served, status_is

Stub = registry_pb2_grpc.RegistryServiceStub


@pytest.fixture
async def registry() -> AsyncIterator[tuple[Replica, Stub, ManualClock]]:
    clock = ManualClock()
    replica = Replica(clock=clock)
    async with running(replica), served(replica) as address, aio_channel(address) as channel:
        yield replica, Stub(channel), clock


def test_every_rpc_of_the_proto_is_implemented() -> None:
    service = r.DESCRIPTOR.services_by_name["RegistryService"]
    base = registry_pb2_grpc.RegistryServiceServicer
    missing = [
        method.name
        for method in service.methods
        if getattr(RegistryServicer, method.name) is getattr(base, method.name)
    ]
    assert not missing


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("worker.id", "is required"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unavailable("stopping"), grpc.StatusCode.UNAVAILABLE),
        (SequenceGap("w1", 3, 5), grpc.StatusCode.UNAVAILABLE),
        (RegistryError("other"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_registry_errors_map_to_one_status_each(error: Exception, code: grpc.StatusCode) -> None:
    assert map_error(error) == (code, str(error))


def test_foreign_errors_are_not_mapped() -> None:
    assert map_error(KeyError("x")) is None


@pytest.mark.parametrize(
    ("worker", "field"),
    [
        (None, "worker"),
        (pb.WorkerInfo(region="ams", address="127.0.0.1:1"), "worker.id"),
        (pb.WorkerInfo(id="w_1", region="ams", address="127.0.0.1:1"), "worker.id"),
        (pb.WorkerInfo(id="w1", address="127.0.0.1:1"), "worker.region"),
        (pb.WorkerInfo(id="w1", region="AMS", address="127.0.0.1:1"), "worker.region"),
        (pb.WorkerInfo(id="w1", region="ams", address=""), "worker.address"),
        (pb.WorkerInfo(id="w1", region="ams", address="localhost"), "worker.address"),
        (pb.WorkerInfo(id="w1", region="ams", address="::1:80"), "worker.address"),
    ],
)
async def test_announce_refuses_bad_input_naming_the_field(
    registry: tuple[Replica, Stub, ManualClock], worker: pb.WorkerInfo | None, field: str
) -> None:
    replica, stub, _ = registry
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Announce(r.AnnounceRequest(worker=worker), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: ")
    assert replica.workers() == []  # nothing changed


async def test_announce_and_list_members(registry: tuple[Replica, Stub, ManualClock]) -> None:
    replica, stub, clock = registry
    worker = FakeWorker("w1", "ams", heartbeat_interval=0.05)
    await worker.serve()
    try:
        resp = await stub.Announce(r.AnnounceRequest(worker=worker.info), timeout=5)
        assert [info.id for info in resp.workers] == ["w1"]
        ghost = pb.WorkerInfo(id="w2", region="syd", address="127.0.0.1:9")
        await stub.Announce(r.AnnounceRequest(worker=ghost), timeout=5)
        await eventually(replica, status_is(replica, "w1", ALIVE), "w1 alive")
        clock.advance(1.5)
        # w2 was never heard from; w1 keeps beating (and is alive again after its next beat)
        w1_alive, w2_dead = status_is(replica, "w1", ALIVE), status_is(replica, "w2", DEAD)
        await eventually(replica, lambda: w1_alive() and w2_dead(), "w1 alive, w2 dead")
        members = {m.worker.id: m for m in (await stub.ListMembers(r.ListMembersRequest())).members}
        assert members["w1"].status == r.MEMBER_STATUS_ALIVE
        assert members["w1"].worker.address == worker.address
        assert members["w1"].capacity.total.machines == 100
        assert members["w1"].last_heartbeat.seconds > 0
        assert members["w2"].status == r.MEMBER_STATUS_DEAD
        assert not members["w2"].HasField("last_heartbeat")
    finally:
        await worker.stop()


# -- standalone settings ---------------------------------------------------------------------


def test_settings_defaults_and_flags() -> None:
    settings = load_settings(
        RegistrySettings,
        ["--workers", "127.0.0.1:1,127.0.0.1:2", "--peers", "10.0.0.1:7000", "--dead-after", "3"],
        prog="registry",
    )
    assert settings.workers == ["127.0.0.1:1", "127.0.0.1:2"]
    assert settings.peers == ["10.0.0.1:7000"]
    assert settings.upstream is None
    assert (settings.suspect_after, settings.dead_after) == (0.6, 3.0)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workers", "nohost"], "workers"),
        (["--peers", "a:b"], "peers"),
        (["--upstream", "x"], "upstream"),
        (["--suspect-after", "0"], "suspect_after"),
        (["--suspect-after", "2", "--dead-after", "1"], "dead_after"),
        (["--retry-max", "0"], "retry_max"),
    ],
)
def test_bad_settings_name_the_setting(argv: list[str], named: str) -> None:
    with pytest.raises(SettingsError, match=f"registry: invalid setting {named}"):
        load_settings(RegistrySettings, argv, prog="registry")
