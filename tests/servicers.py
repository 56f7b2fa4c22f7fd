"""What the in-process servicer tests (tests/<service>/test_servicer.py) share.

Those modules use pytest-grpc-aio's fixtures: a module names its servicer (`grpc_servicer`),
how it is added to a server (`grpc_add_to_server`, built with `registered` so errors are
mapped as in production) and its stub class (`grpc_stub_cls`); the plugin serves it on a
grpc.aio server for the test, and the `servicer_stub` fixture (tests/conftest.py) is a stub
to it. `refused` reads a failed call's status. `untested` names the RPCs of a service that a
test module never calls: each module checks its own, so a new RPC fails there until it has a
test. `serving` runs a whole `runtime.Service` in the test's loop, for the servers a servicer
under test calls (flyd workers behind flaps).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2

from flyd.v1 import machine_pb2 as pb
from runtime import ErrorMapper, Service, error_info, register
from runtime.limits import DEFAULT_LIMITS, Limits

# How long a test waits for a server or a condition (never reached when things work).
DEADLINE = 10.0
# The gRPC deadline of every call a test makes.
T = 5.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def registered(
    add_to_server: Callable[[Any, Any], None],
    service: ServiceDescriptor,
    mapper: ErrorMapper,
    limits: Limits = DEFAULT_LIMITS,
) -> Callable[[Any, Any], None]:
    """A `grpc_add_to_server` that registers a servicer the way `runtime.Service.add` does
    (`runtime.register`): its handlers wrapped by `wrap_servicer` with the service's
    `map_error`, its requests decoded and checked against the service's `limits`. What the
    tests see is the production error mapping."""

    def add(servicer: Any, server: Any) -> None:
        register(server, servicer, add_to_server, service, mapper, limits)

    return add


async def refused(
    call: Awaitable[object], code: grpc.StatusCode, field: str | None = None
) -> grpc.aio.AioRpcError:
    """Await `call` (a unary call, or a stream's first `read()`): it must fail with `code`,
    and, when `field` is given, with a message that starts by naming that field. Returns the
    error, for a closer look."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    err = caught.value
    assert err.code() == code, f"{err.code().name}: {err.details()}"
    if field is not None:
        assert (err.details() or "").startswith(f"{field}: "), err.details()
    return err


def answer(stub: Any, rpc: str, request: Any) -> Awaitable[object]:
    """Call `rpc` on `stub`: what to await for its answer, the response of a unary RPC or the
    first message of a streaming one (where a streaming RPC's refusal shows)."""
    call = getattr(stub, rpc)(request, timeout=T)
    return call.read() if isinstance(call, grpc.aio.UnaryStreamCall) else call


def untested(service: ServiceDescriptor, tests: ModuleType | type) -> list[str]:
    """The RPCs of `service` that the test code of `tests` (a module or a class) never calls,
    sorted. A call is a stub's attribute (`stub.GetMachine(...)`) or the RPC's name as a
    string (a table row handed to `answer`)."""
    names = {method.name for method in service.methods}
    called = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(tests)))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            called.add(node.attr)
        elif isinstance(node, ast.Constant) and node.value in names:
            called.add(node.value)
    return sorted(names - called)


def info_of(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The google.rpc.ErrorInfo a failed call carries (it must carry one)."""
    info = error_info(err)
    assert info is not None, f"no ErrorInfo with {err.code().name}: {err.details()}"
    return info


@contextlib.asynccontextmanager
async def serving(service: Service) -> AsyncIterator[str]:
    """Run `service`, its servicers added, in this event loop until the block ends; yields the
    address it listens on."""
    task = asyncio.create_task(service.run(handle_signals=False))
    try:
        async with asyncio.timeout(DEADLINE):
            address = await service.wait_ready()
        yield address
    finally:
        service.request_shutdown()
        async with asyncio.timeout(DEADLINE):
            await task


def seconds(s: float) -> Duration:
    """`s` seconds as a Duration field."""
    return Duration(seconds=int(s), nanos=round(s % 1 * 1e9))


async def bring(stub: Any, api: ModuleType, machine_id: str, state: str) -> None:
    """Bring a started machine to `state` through `stub`: a flyd WorkerService or a flaps
    MachinesService stub, `api` its messages module (worker_pb2 or machines_pb2: their requests
    share a layout). `state` is started (left as it is), stopped, destroyed, or leased (a 60 s
    lease held by someone else)."""
    wait = api.WaitMachineRequest(machine_id=machine_id, timeout=seconds(5))
    if state == "stopped":
        await stub.StopMachine(api.StopMachineRequest(machine_id=machine_id), timeout=T)
        wait.state = pb.MACHINE_STATE_STOPPED
        await stub.WaitMachine(wait, timeout=T)
    elif state == "destroyed":
        destroy = api.DestroyMachineRequest(machine_id=machine_id, force=True)
        await stub.DestroyMachine(destroy, timeout=T)
        wait.state = pb.MACHINE_STATE_DESTROYED
        await stub.WaitMachine(wait, timeout=T)
    elif state == "leased":
        lease = api.AcquireLeaseRequest(machine_id=machine_id, ttl=seconds(60), owner="other")
        await stub.AcquireLease(lease, timeout=T)
    else:
        assert state == "started", state
