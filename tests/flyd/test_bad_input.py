"""Every WorkerService RPC refuses bad input with a status naming the problem, changing nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.validate import MAX_DISK_MIB, MIN_DISK_MIB
from tests.conftest import one_flyd
from tests.harness import error_info, grpcurl

C = grpc.StatusCode
S = pb.MachineState


def cfg(**changes: Any) -> pb.MachineConfig:
    config = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        entrypoint=["sleep"],
        cmd=["1000"],
    )
    for path, value in changes.items():
        target: Any = config
        *parents, leaf = path.split("__")
        for part in parents:
            target = getattr(target, part)
        if isinstance(value, list):
            getattr(target, leaf).extend(value)
        elif isinstance(value, dict):
            getattr(target, leaf).update(value)
        else:
            setattr(target, leaf, value)
    return config


def with_service(config: pb.MachineConfig, *ports: int) -> pb.MachineConfig:
    for port in ports:
        config.services.add(internal_port=port)
    return config


def with_check(config: pb.MachineConfig, check: pb.CheckConfig) -> pb.MachineConfig:
    config.checks.append(check)
    return config


def create(**kw: Any) -> w.CreateMachineRequest:
    kw.setdefault("app", "demo")
    kw.setdefault("config", cfg())
    return w.CreateMachineRequest(**kw)


UNKNOWN = "nosuchmachine"
CASES: list[tuple[str, str, Any, grpc.StatusCode, str]] = [
    # (id, rpc, request, code, text the message must contain)
    ("app missing", "CreateMachine", create(app=""), C.INVALID_ARGUMENT, "app"),
    ("app uppercase", "CreateMachine", create(app="Demo"), C.INVALID_ARGUMENT, "app"),
    (
        "machine id format",
        "CreateMachine",
        create(machine_id="a b"),
        C.INVALID_ARGUMENT,
        "machine_id",
    ),
    ("name too long", "CreateMachine", create(name="n" * 64), C.INVALID_ARGUMENT, "name"),
    (
        "image missing",
        "CreateMachine",
        create(config=cfg(image="")),
        C.INVALID_ARGUMENT,
        "config.image",
    ),
    (
        "image malformed",
        "CreateMachine",
        create(config=cfg(image="Bad Image!")),
        C.INVALID_ARGUMENT,
        "config.image",
    ),
    (
        "image unknown",
        "CreateMachine",
        create(config=cfg(image="nosuch:v1")),
        C.NOT_FOUND,
        "nosuch",
    ),
    (
        "zero cpu",
        "CreateMachine",
        create(config=cfg(guest__cpu_millicores=0)),
        C.INVALID_ARGUMENT,
        "config.guest.cpu_millicores",
    ),
    (
        "negative memory",
        "CreateMachine",
        create(config=cfg(guest__memory_mib=-64)),
        C.INVALID_ARGUMENT,
        "config.guest.memory_mib",
    ),
    (
        "negative disk",
        "CreateMachine",
        create(config=cfg(guest__disk_mib=-1)),
        C.INVALID_ARGUMENT,
        "config.guest.disk_mib",
    ),
    (
        "disk under the least a filesystem of its own takes",
        "CreateMachine",
        create(config=cfg(guest__disk_mib=MIN_DISK_MIB - 1)),
        C.INVALID_ARGUMENT,
        "config.guest.disk_mib",
    ),
    (
        "disk over the most a guest may have",
        "CreateMachine",
        create(config=cfg(guest__disk_mib=MAX_DISK_MIB + 1)),
        C.INVALID_ARGUMENT,
        "config.guest.disk_mib",
    ),
    (
        "more disk than the worker has",
        "CreateMachine",
        create(config=cfg(guest__disk_mib=MAX_DISK_MIB)),
        C.RESOURCE_EXHAUSTED,
        "disk",
    ),
    (
        "too big for the worker",
        "CreateMachine",
        create(config=cfg(guest__memory_mib=200_000)),
        C.RESOURCE_EXHAUSTED,
        "memory",
    ),
    (
        "port out of range",
        "CreateMachine",
        create(config=with_service(cfg(), 70000)),
        C.INVALID_ARGUMENT,
        "config.services[0].internal_port",
    ),
    (
        "port repeated",
        "CreateMachine",
        create(config=with_service(cfg(), 8080, 8080)),
        C.INVALID_ARGUMENT,
        "config.services[1].internal_port",
    ),
    (
        "check without kind",
        "CreateMachine",
        create(config=with_check(with_service(cfg(), 8080), pb.CheckConfig(name="c"))),
        C.INVALID_ARGUMENT,
        "config.checks[0]",
    ),
    (
        "check path",
        "CreateMachine",
        create(
            config=with_check(
                with_service(cfg(), 8080), pb.CheckConfig(http=pb.HttpCheck(path="health"))
            )
        ),
        C.INVALID_ARGUMENT,
        "config.checks[0].http.path",
    ),
    (
        "env name",
        "CreateMachine",
        create(config=cfg(env={"1BAD": "x"})),
        C.INVALID_ARGUMENT,
        "config.env",
    ),
    (
        "stop signal",
        "CreateMachine",
        create(config=cfg(stop__signal="SIGNOPE")),
        C.INVALID_ARGUMENT,
        "config.stop.signal",
    ),
    (
        "negative retries",
        "CreateMachine",
        create(config=cfg(restart__max_retries=-1)),
        C.INVALID_ARGUMENT,
        "config.restart.max_retries",
    ),
    (
        "standby id",
        "CreateMachine",
        create(config=cfg(standbys=["Not An Id"])),
        C.INVALID_ARGUMENT,
        "config.standbys[0]",
    ),
    (
        "start unknown",
        "StartMachine",
        w.StartMachineRequest(machine_id=UNKNOWN),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    ("start no id", "StartMachine", w.StartMachineRequest(), C.INVALID_ARGUMENT, "machine_id"),
    ("stop unknown", "StopMachine", w.StopMachineRequest(machine_id=UNKNOWN), C.NOT_FOUND, UNKNOWN),
    (
        "stop bad signal",
        "StopMachine",
        w.StopMachineRequest(machine_id=UNKNOWN, signal="NOPE"),
        C.INVALID_ARGUMENT,
        "signal",
    ),
    (
        "stop negative timeout",
        "StopMachine",
        w.StopMachineRequest(machine_id=UNKNOWN, timeout=Duration(seconds=-1)),
        C.INVALID_ARGUMENT,
        "timeout",
    ),
    (
        "restart unknown",
        "RestartMachine",
        w.RestartMachineRequest(machine_id=UNKNOWN),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "signal missing",
        "SignalMachine",
        w.SignalMachineRequest(machine_id=UNKNOWN),
        C.INVALID_ARGUMENT,
        "signal",
    ),
    (
        "signal unknown name",
        "SignalMachine",
        w.SignalMachineRequest(machine_id=UNKNOWN, signal="SIGWHAT"),
        C.INVALID_ARGUMENT,
        "signal",
    ),
    (
        "destroy unknown",
        "DestroyMachine",
        w.DestroyMachineRequest(machine_id=UNKNOWN),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    ("get unknown", "GetMachine", w.GetMachineRequest(machine_id=UNKNOWN), C.NOT_FOUND, UNKNOWN),
    ("get no id", "GetMachine", w.GetMachineRequest(), C.INVALID_ARGUMENT, "machine_id"),
    (
        "list bad app",
        "ListMachines",
        w.ListMachinesRequest(app="Not_An_App"),
        C.INVALID_ARGUMENT,
        "app",
    ),
    (
        "wait unknown",
        "WaitMachine",
        w.WaitMachineRequest(machine_id=UNKNOWN, state=S.MACHINE_STATE_STARTED),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "wait too long",
        "WaitMachine",
        w.WaitMachineRequest(
            machine_id=UNKNOWN, state=S.MACHINE_STATE_STARTED, timeout=Duration(seconds=61)
        ),
        C.INVALID_ARGUMENT,
        "timeout",
    ),
    (
        "logs unknown",
        "GetMachineLogs",
        w.GetMachineLogsRequest(machine_id=UNKNOWN),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "logs tail",
        "GetMachineLogs",
        w.GetMachineLogsRequest(machine_id=UNKNOWN, tail_lines=-1),
        C.INVALID_ARGUMENT,
        "tail_lines",
    ),
    (
        "watch from the future",
        "WatchEvents",
        w.WatchEventsRequest(from_seq=10**9),
        C.INVALID_ARGUMENT,
        "from_seq",
    ),
    (
        "update unknown",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN, config=cfg()),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "update no id",
        "UpdateMachine",
        w.UpdateMachineRequest(config=cfg()),
        C.INVALID_ARGUMENT,
        "machine_id",
    ),
    (
        "update no config",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN),
        C.INVALID_ARGUMENT,
        "config.image",
    ),
    (
        "update image malformed",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN, config=cfg(image="Bad Image!")),
        C.INVALID_ARGUMENT,
        "config.image",
    ),
    (
        "update zero memory",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN, config=cfg(guest__memory_mib=0)),
        C.INVALID_ARGUMENT,
        "config.guest.memory_mib",
    ),
    (
        "update port repeated",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN, config=with_service(cfg(), 8080, 8080)),
        C.INVALID_ARGUMENT,
        "config.services[1].internal_port",
    ),
    (
        "update stop signal",
        "UpdateMachine",
        w.UpdateMachineRequest(machine_id=UNKNOWN, config=cfg(stop__signal="SIGNOPE")),
        C.INVALID_ARGUMENT,
        "config.stop.signal",
    ),
    (
        "lease unknown",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN, ttl=Duration(seconds=60)),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "lease no id",
        "AcquireLease",
        w.AcquireLeaseRequest(ttl=Duration(seconds=60)),
        C.INVALID_ARGUMENT,
        "machine_id",
    ),
    (
        "lease no ttl",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN),
        C.INVALID_ARGUMENT,
        "ttl",
    ),
    (
        "lease ttl 0",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN, ttl=Duration(seconds=0)),
        C.INVALID_ARGUMENT,
        "ttl",
    ),
    (
        "lease ttl under 1s",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN, ttl=Duration(nanos=500_000_000)),
        C.INVALID_ARGUMENT,
        "ttl",
    ),
    (
        "lease ttl over 1h",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN, ttl=Duration(seconds=3601)),
        C.INVALID_ARGUMENT,
        "ttl",
    ),
    (
        "lease negative ttl",
        "AcquireLease",
        w.AcquireLeaseRequest(machine_id=UNKNOWN, ttl=Duration(seconds=-60)),
        C.INVALID_ARGUMENT,
        "ttl",
    ),
    (
        "release unknown",
        "ReleaseLease",
        w.ReleaseLeaseRequest(machine_id=UNKNOWN, nonce="x"),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    ("release no id", "ReleaseLease", w.ReleaseLeaseRequest(), C.INVALID_ARGUMENT, "machine_id"),
    (
        "events unknown",
        "ListMachineEvents",
        w.ListMachineEventsRequest(machine_id=UNKNOWN),
        C.NOT_FOUND,
        UNKNOWN,
    ),
    (
        "events no id",
        "ListMachineEvents",
        w.ListMachineEventsRequest(),
        C.INVALID_ARGUMENT,
        "machine_id",
    ),
]


@pytest.fixture(scope="module")
def flyd(tmp_path_factory: pytest.TempPathFactory, image_source: Path) -> Iterator[str]:
    with one_flyd(tmp_path_factory.mktemp("bad-input"), image_source) as proc:
        yield proc.address


@pytest.fixture
async def stub(flyd: str) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(flyd) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


async def call(stub: worker_pb2_grpc.WorkerServiceStub, rpc: str, request: Any) -> None:
    method = getattr(stub, rpc)
    if rpc in ("WatchEvents", "GetMachineLogs"):
        async for _ in method(request, timeout=10):
            pass
    else:
        await method(request, timeout=10)


@pytest.mark.parametrize(
    ("rpc", "request_", "code", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
async def test_bad_input_is_refused(
    stub: worker_pb2_grpc.WorkerServiceStub,
    rpc: str,
    request_: Any,
    code: grpc.StatusCode,
    text: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(stub, rpc, request_)
    assert err.value.code() == code, err.value.details()
    assert text in (err.value.details() or "")


async def test_invalid_transitions_are_refused_and_change_nothing(
    stub: worker_pb2_grpc.WorkerServiceStub,
) -> None:
    machine = (await stub.CreateMachine(create(skip_launch=True), timeout=10)).machine
    for rpc, request in [
        ("RestartMachine", w.RestartMachineRequest(machine_id=machine.id)),
        ("SignalMachine", w.SignalMachineRequest(machine_id=machine.id, signal="SIGHUP")),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(stub, rpc, request)
        assert err.value.code() == C.FAILED_PRECONDITION
        assert "created" in (err.value.details() or "")
        assert error_info(err.value) == ("WRONG_STATE", "flyd.nonomad", {})
    # The same id with another config is not the same machine.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateMachine(
            create(machine_id=machine.id, config=cfg(cmd=["2000"])), timeout=10
        )
    assert err.value.code() == C.ALREADY_EXISTS

    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StartMachine(w.StartMachineRequest(machine_id=machine.id), timeout=10)
    assert err.value.code() == C.FAILED_PRECONDITION
    assert "destroyed" in (err.value.details() or "")
    assert error_info(err.value) == ("MACHINE_DESTROYED", "flyd.nonomad", {})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.WaitMachine(
            w.WaitMachineRequest(machine_id=machine.id, state=S.MACHINE_STATE_STARTED), timeout=10
        )
    assert err.value.code() == C.FAILED_PRECONDITION
    assert error_info(err.value) == ("MACHINE_DESTROYED", "flyd.nonomad", {})
    # Nor can a destroyed machine be updated or leased.
    for rpc, request in [
        ("UpdateMachine", w.UpdateMachineRequest(machine_id=machine.id, config=cfg())),
        ("AcquireLease", w.AcquireLeaseRequest(machine_id=machine.id, ttl=Duration(seconds=60))),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(stub, rpc, request)
        assert err.value.code() == C.FAILED_PRECONDITION
        assert "destroyed" in (err.value.details() or "")
        assert error_info(err.value) == ("MACHINE_DESTROYED", "flyd.nonomad", {})

    history = (await stub.GetMachine(w.GetMachineRequest(machine_id=machine.id))).machine.events
    assert [e.to_state for e in history] == [
        S.MACHINE_STATE_CREATED,
        S.MACHINE_STATE_DESTROYING,
        S.MACHINE_STATE_DESTROYED,
    ]


async def test_refused_calls_leave_no_trace(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    """Run after the tables: only the one machine of the transition test was ever recorded."""
    first = await anext(aiter(stub.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=10)))
    machines = first.snapshot.machines
    assert len(machines) <= 1
    assert all(m.app == "demo" for m in machines)
    assert first.snapshot.seq == (3 if machines else 0)


async def test_grpcurl_shows_the_reason(flyd: str, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    machine = (await stub.CreateMachine(create(skip_launch=True), timeout=10)).machine
    request = json.dumps({"machine_id": machine.id, "signal": "SIGHUP"})
    out = grpcurl("-plaintext", "-d", request, flyd, "flyd.v1.WorkerService/SignalMachine")

    assert out.returncode != 0
    assert "Code: FailedPrecondition" in out.stdout + out.stderr
    assert '"reason":"WRONG_STATE"' in (out.stdout + out.stderr).replace(" ", "")
    await stub.DestroyMachine(w.DestroyMachineRequest(machine_id=machine.id), timeout=10)
