"""The WorkerService fixtures the servicer tests share (pytest-grpc-aio asks for them by
name): a Worker over the fake driver, the servicer on it wrapped with flyd.service.map_error as
flyd.main registers it, its settings; and the calls most tests make."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from flyd.service import LIMITS, WorkerServicer, map_error
from flyd.settings import LOG_READ_BYTES, STREAMS_PER_CALLER
from flyd.store import MemoryMachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from tests.flyd.support import Flyd, Node, config
from tests.servicers import T, registered

Stub = worker_pb2_grpc.WorkerServiceStub


@pytest.fixture
def grpc_add_to_server() -> Callable[[Any, Any], None]:
    return registered(
        worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        w.DESCRIPTOR.services_by_name["WorkerService"],
        map_error,
        LIMITS,
    )


@pytest.fixture
def grpc_stub_cls() -> type[Stub]:
    return Stub


@pytest.fixture
def flyd(node: Node) -> Flyd:
    """Worker w1 (ams) with an in-memory log, its machines on the node's fake host."""
    return node.boot(store=MemoryMachineLog())


@pytest.fixture
def draining() -> asyncio.Event:
    """flyd's Service.draining: set when shutdown begins, ending streams."""
    return asyncio.Event()


@pytest.fixture
def heartbeat_interval() -> float:
    """Seconds between WatchEvents heartbeats (real time: the stream's own loop timer)."""
    return 60.0


@pytest.fixture
def log_read_bytes() -> int:
    """The most of a log one GetMachineLogs reads (flyd --log-read-bytes)."""
    return LOG_READ_BYTES


@pytest.fixture
def streams_per_caller() -> int:
    """Follow streams (and waits, event streams) one caller may hold (--streams-per-caller)."""
    return STREAMS_PER_CALLER


@pytest.fixture
def grpc_servicer(
    flyd: Flyd,
    draining: asyncio.Event,
    heartbeat_interval: float,
    log_read_bytes: int,
    streams_per_caller: int,
) -> WorkerServicer:
    return WorkerServicer(
        flyd.worker,
        heartbeat_interval=heartbeat_interval,
        draining=draining,
        log_read_bytes=log_read_bytes,
        streams_per_caller=streams_per_caller,
    )


async def create(
    stub: Stub,
    machine_id: str = "m1",
    cfg: pb.MachineConfig | None = None,
    *,
    app: str = "web",
    **fields: Any,
) -> pb.Machine:
    request = w.CreateMachineRequest(
        machine_id=machine_id, app=app, config=cfg if cfg is not None else config(), **fields
    )
    return (await stub.CreateMachine(request, timeout=T)).machine


async def wait(stub: Stub, state: int, machine_id: str = "m1") -> pb.Machine:
    request = w.WaitMachineRequest(machine_id=machine_id, state=state)  # type: ignore[arg-type]
    return (await stub.WaitMachine(request, timeout=T)).machine
