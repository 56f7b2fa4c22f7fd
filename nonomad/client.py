"""A typed Python client for flaps: the Machines API and the Platform API.

    from nonomad.client import Client, MachineConfig, GuestConfig

    async with Client("127.0.0.1:4280") as flaps:
        machine = await flaps.create_machine(
            "demo", MachineConfig(image="demo:v1", guest=GuestConfig(cpu_millicores=250,
            memory_mib=128)), region="ams")
        await flaps.wait_machine(machine.id, "started")
        async for line in flaps.machine_logs(machine.id, tail_lines=10):
            print(line)

Every call has a deadline (`timeout`, default 30 s; waits get their own timeout plus a margin).
Errors are raised as `ApiError` subclasses by gRPC status (`NotFound`, `ResourceExhausted`, ...)
that keep the status code, its message and, for RESOURCE_EXHAUSTED, the rejections by reason.
Messages are the generated protobuf classes of `flyd.v1` and `flaps.v1`, re-exported here.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import grpc
import grpc.aio
from google.protobuf.duration_pb2 import Duration

from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from runtime.status import error_info
from runtime.tracing import ChannelTLS, aio_channel

__all__ = [
    "AlreadyExists",
    "ApiError",
    "Candidate",
    "ChannelTLS",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GuestConfig",
    "InvalidArgument",
    "Lease",
    "Machine",
    "MachineConfig",
    "MachineEvent",
    "MachineState",
    "NotFound",
    "PermissionDenied",
    "PlacementDecision",
    "PlacementEvent",
    "Region",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Worker",
    "parse_state",
    "state_name",
]

Machine = pb.Machine
MachineConfig = pb.MachineConfig
GuestConfig = pb.GuestConfig
MachineEvent = pb.MachineEvent
Lease = pb.Lease
MachineState = pb.MachineState
Region = platform_pb2.Region
Worker = platform_pb2.Worker
Candidate = platform_pb2.Candidate
PlacementDecision = pb.PlacementDecision
PlacementEvent = platform_pb2.PlacementEvent

DEFAULT_TIMEOUT = 30.0
MAX_WAIT = 60.0  # flaps' WaitMachine limit
LIST_PAGE = 1000  # the most machines flaps puts on one page
_WAIT_MARGIN = 5.0  # the RPC deadline beyond the server-side wait, for the round trip


# -- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """A call failed. `code` is the gRPC status, `message` the server's explanation."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    _by_code: ClassVar[dict[grpc.StatusCode, type[ApiError]]] = {}

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        super().__init__(f"{method}: {code.name}: {message}" if method else message)
        self.code = code
        self.message = message
        self.method = method
        self.reason = ""
        """The server's machine-readable reason (google.rpc.ErrorInfo), when it gave one: from
        flaps NO_CAPACITY; from a worker MACHINE_BUSY, LEASE_HELD, MACHINE_DESTROYED,
        INSTANCE_REPLACED, WRONG_STATE or NO_ROOM; from either IMAGE_DENIED (the app may not
        run `config.image`: metadata `image` and `owner`, docs/images.md)."""
        self.metadata: dict[str, str] = {}
        """What came with the reason (NO_ROOM: the resource that ran out)."""
        self.rejections: dict[str, int] = {}
        """For RESOURCE_EXHAUSTED from placement: how many workers refused, by reason."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ApiError._by_code[cls.code] = cls

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError, method: str = "") -> ApiError:
        """The ApiError subclass for the status of `err`, with its rich details decoded."""
        code = err.code()
        error = cls._by_code.get(code, ApiError)(code, err.details() or "", method)
        info = error_info(err)
        if info is not None:
            error.reason = info.reason
            error.metadata = dict(info.metadata)
            if info.reason == "NO_CAPACITY":
                error.rejections = {k: int(v) for k, v in info.metadata.items() if v.isdigit()}
        return error


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ApiError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ApiError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ApiError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ApiError):
    code = grpc.StatusCode.PERMISSION_DENIED


# -- helpers -----------------------------------------------------------------------------------


def parse_state(state: str | int) -> pb.MachineState.ValueType:
    """`"started"`, `"MACHINE_STATE_STARTED"` or the enum number, as a MachineState."""
    if isinstance(state, int):
        if state not in pb.MachineState.values():
            raise ValueError(f"unknown machine state number {state}")
        return pb.MachineState.ValueType(state)
    name = state.strip().upper()
    if not name.startswith("MACHINE_STATE_"):
        name = f"MACHINE_STATE_{name}"
    try:
        return pb.MachineState.Value(name)
    except ValueError:
        known = ", ".join(state_name(v) for v in pb.MachineState.values() if v)
        raise ValueError(f"unknown machine state {state!r} (one of {known})") from None


def state_name(state: int) -> str:
    """MACHINE_STATE_STARTED -> "started"."""
    return (
        pb.MachineState.Name(pb.MachineState.ValueType(state))
        .removeprefix("MACHINE_STATE_")
        .lower()
    )


def _duration(seconds: float) -> Duration:
    whole = int(seconds)
    return Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


# -- the client --------------------------------------------------------------------------------


class Client:
    """An asyncio client for one flaps (any flaps of the fleet will do: they are stateless).

    `address` is `host:port`. `tls` verifies the server (and, with a client certificate, does
    mutual TLS); `token` is sent as `authorization: Bearer <token>` on every call (flaps started
    with `--auth-token-file`). `token_file` reads it from a file. `timeout` is the deadline of
    every call that does not take its own.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: ChannelTLS | None = None,
        token: str | None = None,
        token_file: Path | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if token is not None and token_file is not None:
            raise ValueError("Client: give token or token_file, not both")
        if token_file is not None:
            token = token_file.read_text().strip()
        if timeout <= 0:
            raise ValueError(f"Client: timeout must be > 0, got {timeout}")
        self.address = address
        self.timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._channel = aio_channel(address, tls=tls)
        self._owns_channel = True
        self._machines = machines_pb2_grpc.MachinesServiceStub(self._channel)
        self._platform = platform_pb2_grpc.PlatformServiceStub(self._channel)

    def with_token(self, token: str) -> Client:
        """A client of the same flaps over the same channel that sends `token` instead: one
        process calling for several callers (the console, for each operator logged in) opens
        one connection, and flaps checks each call against its own caller's token. Closing it
        leaves the channel open; closing this client closes it for both."""
        other = copy.copy(self)
        other._metadata = (("authorization", f"Bearer {token}"),)
        other._owns_channel = False
        return other

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (unless it is another client's, `with_token`); calls in flight
        are cancelled."""
        if self._owns_channel:
            await self._channel.close()

    async def _unary(self, method: Any, name: str, request: Any, timeout: float | None) -> Any:
        try:
            return await method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as err:
            raise ApiError.from_rpc(err, name) from None

    # -- Machines API --------------------------------------------------------------------------

    async def create_machine(
        self,
        app: str,
        config: pb.MachineConfig,
        *,
        region: str = "",
        regions: Sequence[str] = (),
        name: str = "",
        skip_launch: bool = False,
        standby_for: Iterable[str] = (),
        idempotency_key: str = "",
        secrets_from: str = "",
        timeout: float | None = None,
    ) -> pb.Machine:
        """Place and create a machine in `region` (or the first of `regions` with room).

        Fails fast with ResourceExhausted (its `rejections` say why, by reason) when no worker
        can take it. With `standby_for`, the machine is a stopped standby on a worker other than
        each named machine's. The same `idempotency_key` returns the same machine on retry.
        `secrets_from` names a machine of the app whose secrets it gets too (those `config`
        does not set).
        """
        response = await self._create(
            app,
            config,
            region,
            regions,
            name,
            skip_launch,
            standby_for,
            idempotency_key,
            secrets_from,
            None,
            timeout,
        )
        return response.machine

    async def create_machine_with_lease(
        self,
        app: str,
        config: pb.MachineConfig,
        lease_ttl: float,
        *,
        region: str = "",
        regions: Sequence[str] = (),
        name: str = "",
        skip_launch: bool = False,
        standby_for: Iterable[str] = (),
        idempotency_key: str = "",
        secrets_from: str = "",
        timeout: float | None = None,
    ) -> tuple[pb.Machine, pb.Lease]:
        """`create_machine`, holding a lease of `lease_ttl` seconds on the new machine."""
        response = await self._create(
            app,
            config,
            region,
            regions,
            name,
            skip_launch,
            standby_for,
            idempotency_key,
            secrets_from,
            lease_ttl,
            timeout,
        )
        return response.machine, response.lease

    async def _create(
        self,
        app: str,
        config: pb.MachineConfig,
        region: str,
        regions: Sequence[str],
        name: str,
        skip_launch: bool,
        standby_for: Iterable[str],
        idempotency_key: str,
        secrets_from: str,
        lease_ttl: float | None,
        timeout: float | None,
    ) -> m.CreateMachineResponse:
        request = m.CreateMachineRequest(
            app=app,
            region=region,
            regions=list(regions),
            config=config,
            name=name,
            skip_launch=skip_launch,
            standby_for=list(standby_for),
            idempotency_key=idempotency_key,
            secrets_from=secrets_from,
        )
        if lease_ttl is not None:
            request.lease_ttl.CopyFrom(_duration(lease_ttl))
        response: m.CreateMachineResponse = await self._unary(
            self._machines.CreateMachine, "CreateMachine", request, timeout
        )
        return response

    async def get_machine(self, machine_id: str, *, timeout: float | None = None) -> pb.Machine:
        """The machine as its worker has it now."""
        request = m.GetMachineRequest(machine_id=machine_id)
        response = await self._unary(self._machines.GetMachine, "GetMachine", request, timeout)
        return response.machine

    async def list_machines(
        self,
        app: str,
        *,
        region: str = "",
        state: str | int | None = None,
        include_destroyed: bool = False,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> list[pb.Machine]:
        """An app's machines across the fleet, as the registry replica sees them (every page,
        or the first `limit` machines; `timeout` is each page's)."""
        if limit is not None and limit < 1:
            raise ValueError(f"list_machines: limit must be 1 or more, got {limit}")
        request = m.ListMachinesRequest(
            app=app,
            region=region,
            state=parse_state(state) if state is not None else pb.MACHINE_STATE_UNSPECIFIED,
            include_destroyed=include_destroyed,
            page_size=min(limit, LIST_PAGE) if limit is not None else 0,
        )
        machines: list[pb.Machine] = []
        while True:
            response = await self._unary(
                self._machines.ListMachines, "ListMachines", request, timeout
            )
            machines.extend(response.machines)
            if limit is not None and len(machines) >= limit:
                return machines[:limit]
            if not response.next_page_token:
                return machines
            request.page_token = response.next_page_token

    async def update_machine(
        self,
        machine_id: str,
        config: pb.MachineConfig,
        *,
        skip_launch: bool = False,
        lease_nonce: str = "",
        timeout: float | None = None,
    ) -> pb.Machine:
        """Replace the machine's config in place (same id, new instance_id)."""
        request = m.UpdateMachineRequest(
            machine_id=machine_id, config=config, skip_launch=skip_launch, lease_nonce=lease_nonce
        )
        return await self._machine_call("UpdateMachine", request, timeout)

    async def start_machine(
        self,
        machine_id: str,
        *,
        lease_nonce: str = "",
        generation: int = 0,
        timeout: float | None = None,
    ) -> pb.Machine:
        """Start a stopped or created machine; a standby is promoted in its slot (at
        `generation`, or the next one flaps knows of: docs/fencing.md)."""
        request = m.StartMachineRequest(
            machine_id=machine_id, lease_nonce=lease_nonce, generation=generation
        )
        return await self._machine_call("StartMachine", request, timeout)

    async def supersede_machine(
        self, machine_id: str, generation: int, primary: str, *, timeout: float | None = None
    ) -> pb.Machine:
        """Tell the machine's worker that `primary` serves its slot at `generation`: when that
        outranks the machine's claim, it stops and stands by for `primary`."""
        request = m.SupersedeMachineRequest(
            machine_id=machine_id, generation=generation, primary=primary
        )
        return await self._machine_call("SupersedeMachine", request, timeout)

    async def stop_machine(
        self,
        machine_id: str,
        *,
        signal: str = "",
        kill_timeout: float | None = None,
        lease_nonce: str = "",
        timeout: float | None = None,
    ) -> pb.Machine:
        """Stop a machine: `signal` (default the config's), `kill_timeout` s later SIGKILL."""
        request = m.StopMachineRequest(
            machine_id=machine_id, signal=signal, lease_nonce=lease_nonce
        )
        if kill_timeout is not None:
            request.timeout.CopyFrom(_duration(kill_timeout))
        return await self._machine_call("StopMachine", request, timeout)

    async def restart_machine(
        self,
        machine_id: str,
        *,
        signal: str = "",
        kill_timeout: float | None = None,
        lease_nonce: str = "",
        timeout: float | None = None,
    ) -> pb.Machine:
        """Stop and start a started machine."""
        request = m.RestartMachineRequest(
            machine_id=machine_id, signal=signal, lease_nonce=lease_nonce
        )
        if kill_timeout is not None:
            request.timeout.CopyFrom(_duration(kill_timeout))
        return await self._machine_call("RestartMachine", request, timeout)

    async def signal_machine(
        self, machine_id: str, signal: str, *, lease_nonce: str = "", timeout: float | None = None
    ) -> pb.Machine:
        """Send `signal` (a name such as "SIGHUP") to the machine's main process."""
        request = m.SignalMachineRequest(
            machine_id=machine_id, signal=signal, lease_nonce=lease_nonce
        )
        return await self._machine_call("SignalMachine", request, timeout)

    async def destroy_machine(
        self,
        machine_id: str,
        *,
        force: bool = False,
        lease_nonce: str = "",
        timeout: float | None = None,
    ) -> pb.Machine:
        """Destroy a machine and release its reservation; `force` for a started one."""
        request = m.DestroyMachineRequest(
            machine_id=machine_id, force=force, lease_nonce=lease_nonce
        )
        return await self._machine_call("DestroyMachine", request, timeout)

    async def wait_machine(
        self,
        machine_id: str,
        state: str | int,
        *,
        wait: float = 30.0,
        instance_id: str = "",
        ready: bool = False,
    ) -> pb.Machine:
        """Wait up to `wait` seconds (at most 60) for the machine to be in `state`; with
        `ready` (state "started" only), until it also serves: its ports accept and its checks
        pass (`machine.ready`).

        Returns at once when it already is. DeadlineExceeded when the wait runs out, its message
        saying why it is not ready ("nothing listening on 8080 after 10s", "crash-looping: exit
        1, 3 restarts; last log: ..."); FailedPrecondition when it failed.
        """
        if not 0 < wait <= MAX_WAIT:
            raise ValueError(f"wait must be in (0, {MAX_WAIT:g}] seconds, got {wait}")
        target = parse_state(state)
        if ready and target != pb.MACHINE_STATE_STARTED:
            raise ValueError(f"ready: only a wait for started can wait for ready, not {state!r}")
        request = m.WaitMachineRequest(
            machine_id=machine_id,
            state=target,
            timeout=_duration(wait),
            instance_id=instance_id,
            ready=ready,
        )
        return await self._machine_call("WaitMachine", request, wait + _WAIT_MARGIN)

    async def _machine_call(self, name: str, request: Any, timeout: float | None) -> pb.Machine:
        response = await self._unary(getattr(self._machines, name), name, request, timeout)
        return response.machine

    async def acquire_lease(
        self,
        machine_id: str,
        ttl: float,
        *,
        owner: str = "",
        description: str = "",
        nonce: str = "",
        timeout: float | None = None,
    ) -> pb.Lease:
        """Take (or, with the current `nonce`, refresh) an exclusive lease for `ttl` seconds."""
        request = m.AcquireLeaseRequest(
            machine_id=machine_id,
            ttl=_duration(ttl),
            owner=owner,
            description=description,
            nonce=nonce,
        )
        response = await self._unary(self._machines.AcquireLease, "AcquireLease", request, timeout)
        return response.lease

    async def release_lease(
        self, machine_id: str, nonce: str, *, timeout: float | None = None
    ) -> None:
        """Release the lease with `nonce`."""
        request = m.ReleaseLeaseRequest(machine_id=machine_id, nonce=nonce)
        await self._unary(self._machines.ReleaseLease, "ReleaseLease", request, timeout)

    async def list_machine_events(
        self, machine_id: str, *, timeout: float | None = None
    ) -> list[pb.MachineEvent]:
        """The machine's recorded state changes, oldest first."""
        request = m.ListMachineEventsRequest(machine_id=machine_id)
        response = await self._unary(
            self._machines.ListMachineEvents, "ListMachineEvents", request, timeout
        )
        return list(response.events)

    async def machine_logs(
        self,
        machine_id: str,
        *,
        tail_lines: int = 100,
        follow: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[str]:
        """The machine's last `tail_lines` log lines; with `follow`, then new lines as they come.

        Without `follow` the stream has the usual deadline; with it, it runs until the caller
        stops iterating (or `timeout`, when given).
        """
        request = m.GetMachineLogsRequest(
            machine_id=machine_id, tail_lines=tail_lines, follow=follow
        )
        deadline = timeout if timeout is not None else (None if follow else self.timeout)
        call = self._machines.GetMachineLogs(request, timeout=deadline, metadata=self._metadata)
        try:
            async for item in call:
                yield item.line
        except grpc.aio.AioRpcError as err:
            raise ApiError.from_rpc(err, "GetMachineLogs") from None
        finally:
            call.cancel()

    async def get_placement(
        self, machine_id: str, *, timeout: float | None = None
    ) -> pb.PlacementDecision | None:
        """Why the machine is on its worker: the placement decision flaps made when it created
        it (candidates and sub-scores, rejections by reason, regions tried before), as its
        worker keeps it. None for a machine made straight on a worker, or destroyed."""
        request = m.GetPlacementRequest(machine_id=machine_id)
        response = await self._unary(self._machines.GetPlacement, "GetPlacement", request, timeout)
        return response.placement if response.HasField("placement") else None

    # -- Platform API --------------------------------------------------------------------------

    async def list_regions(
        self, *, guest: pb.GuestConfig | None = None, timeout: float | None = None
    ) -> list[platform_pb2.Region]:
        """Each region's workers and free capacity; with `guest`, how many of that size fit."""
        request = platform_pb2.ListRegionsRequest(guest=guest)
        response = await self._unary(self._platform.ListRegions, "ListRegions", request, timeout)
        return list(response.regions)

    async def list_workers(
        self, *, region: str = "", timeout: float | None = None
    ) -> list[platform_pb2.Worker]:
        """The workers flaps knows, with liveness and capacity (every page of them)."""
        workers: list[platform_pb2.Worker] = []
        token = ""
        while True:
            request = platform_pb2.ListWorkersRequest(region=region, page_token=token)
            response = await self._unary(
                self._platform.ListWorkers, "ListWorkers", request, timeout
            )
            workers += response.workers
            token = response.next_page_token
            if not token:
                return workers

    async def simulate_placement(
        self,
        app: str,
        config: pb.MachineConfig,
        *,
        region: str = "",
        regions: Sequence[str] = (),
        standby_for: Iterable[str] = (),
        timeout: float | None = None,
    ) -> platform_pb2.SimulatePlacementResponse:
        """What CreateMachine would do now: ranked candidates and rejections. Changes nothing."""
        request = platform_pb2.SimulatePlacementRequest(
            app=app,
            region=region,
            regions=list(regions),
            config=config,
            standby_for=list(standby_for),
        )
        response: platform_pb2.SimulatePlacementResponse = await self._unary(
            self._platform.SimulatePlacement, "SimulatePlacement", request, timeout
        )
        return response

    async def cordon_worker(
        self, worker_id: str, cordoned: bool = True, *, timeout: float | None = None
    ) -> bool:
        """Cordon a worker (`cordoned=False`: uncordon it): a cordoned worker takes no new
        machines while its machines keep running. Needs a token with the admin operation
        `cordon`. Returns whether the worker is cordoned now."""
        request = platform_pb2.CordonWorkerRequest(worker_id=worker_id, cordoned=cordoned)
        response = await self._unary(self._platform.CordonWorker, "CordonWorker", request, timeout)
        return bool(response.cordoned)

    async def watch_placements(
        self, *, subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[platform_pb2.WatchPlacementsResponse]:
        """This flaps' placement decisions from now on, one per region tried, until the caller
        stops iterating (`dropped` on one: some before it were missed). `subscribed()` is
        called once flaps has registered the watch: every decision after it arrives."""
        call = self._platform.WatchPlacements(
            platform_pb2.WatchPlacementsRequest(), metadata=self._metadata
        )
        try:
            await call.initial_metadata()
            if subscribed is not None and not call.done():
                subscribed()
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as err:
            raise ApiError.from_rpc(err, "WatchPlacements") from None
        finally:
            call.cancel()
