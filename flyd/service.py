"""flyd.v1.WorkerService over gRPC, and the one place flyd errors become status codes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
from google.rpc.error_details_pb2 import ErrorInfo

from flyd.settings import LOG_READ_BYTES, STREAMS_PER_CALLER
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from flyd.worker import Worker
from model.errors import (
    DOMAIN,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    FlydError,
    ImageDenied,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    UnsafeImage,
)
from model.pages import page
from model.validate import CONFIG_LIMITS, PLACEMENT_LIMITS
from runtime import Mapped
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.streams import CallerCaps, caller_name
from runtime.validate import check_name, duration_seconds, parse_signal

# Checked in order: the first matching class decides (subclasses before their bases).
_CODES: list[tuple[type[FlydError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (UnsafeImage, grpc.StatusCode.FAILED_PRECONDITION),
    (ImageDenied, grpc.StatusCode.PERMISSION_DENIED),
]

_OTHER = grpc.StatusCode.FAILED_PRECONDITION

MAX_WAIT = 60.0
DEFAULT_WAIT = 30.0
MAX_TAIL = 10_000
MAX_LINE = 64 * 1024
MAX_LEASE = 3600.0
# Signals whose default action stops a process: a frozen machine would still show as started,
# hold its reservation and have the edge send it requests it never answers.
FREEZING_SIGNALS = frozenset(
    int(s) for s in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
)

LIMITS = DEFAULT_LIMITS.merged(
    CONFIG_LIMITS,
    PLACEMENT_LIMITS,
    Limits(
        texts={
            "flyd.v1.AcquireLeaseRequest.owner": 256,
            "flyd.v1.CreateMachineRequest.name": 63,
            "flyd.v1.CreateMachineRequest.idempotency_key": 256,
            "flyd.v1.StopMachineRequest.signal": 16,
            "flyd.v1.RestartMachineRequest.signal": 16,
            "flyd.v1.SignalMachineRequest.signal": 16,
        }
    ),
)
"""The bounds of WorkerService requests, checked as each is decoded (`runtime.limits`)."""


def map_error(err: Exception) -> Mapped | None:
    """flyd's errors as gRPC statuses, with an ErrorInfo when the error names a reason; None
    for anything else (reported as INTERNAL)."""
    if not isinstance(err, FlydError):
        return None
    # other image errors, a corrupt log
    code = next((code for cls, code in _CODES if isinstance(err, cls)), _OTHER)
    if not err.reason:
        return code, str(err)
    return code, str(err), ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin translation between requests and the Worker; all logic lives there."""

    def __init__(
        self,
        worker: Worker,
        *,
        heartbeat_interval: float,
        draining: asyncio.Event,
        log_read_bytes: int = LOG_READ_BYTES,
        streams_per_caller: int = STREAMS_PER_CALLER,
    ) -> None:
        self.worker = worker
        self.heartbeat_interval = heartbeat_interval
        self.draining = draining
        self.log_read_bytes = log_read_bytes
        self.streams = CallerCaps(
            limit=streams_per_caller, setting="--streams-per-caller", domain=DOMAIN
        )

    async def CreateMachine(
        self, request: w.CreateMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.CreateMachineResponse:
        remaining = context.time_remaining()
        machine = await self.worker.create(
            machine_id=request.machine_id,
            name=request.name,
            app=request.app,
            config=request.config,
            skip_launch=request.skip_launch,
            idempotency_key=request.idempotency_key,
            deadline=None if remaining is None else asyncio.get_running_loop().time() + remaining,
            placement=request.placement if request.HasField("placement") else None,
            not_after=(
                request.not_after.ToNanoseconds() / 1e9 if request.HasField("not_after") else None
            ),
        )
        return w.CreateMachineResponse(machine=machine)

    async def StartMachine(
        self, request: w.StartMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.StartMachineResponse:
        machine = await self.worker.start(
            request.machine_id, lease_nonce=request.lease_nonce, generation=request.generation
        )
        return w.StartMachineResponse(machine=machine)

    async def SupersedeMachine(
        self, request: w.SupersedeMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.SupersedeMachineResponse:
        machine = await self.worker.supersede(
            request.machine_id, request.generation, request.primary, request.primary_app
        )
        return w.SupersedeMachineResponse(machine=machine)

    def _stop_args(
        self, request: w.StopMachineRequest | w.RestartMachineRequest
    ) -> tuple[int | None, float | None]:
        sig = parse_signal("signal", request.signal) if request.signal else None
        timeout = (
            duration_seconds("timeout", request.timeout, default=0, maximum=300, present=True)
            if request.HasField("timeout")
            else None
        )
        return sig, timeout

    async def StopMachine(
        self, request: w.StopMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.StopMachineResponse:
        sig, timeout = self._stop_args(request)
        return w.StopMachineResponse(
            machine=await self.worker.stop(
                request.machine_id, sig, timeout, lease_nonce=request.lease_nonce
            )
        )

    async def RestartMachine(
        self, request: w.RestartMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.RestartMachineResponse:
        sig, timeout = self._stop_args(request)
        return w.RestartMachineResponse(
            machine=await self.worker.restart(
                request.machine_id, sig, timeout, lease_nonce=request.lease_nonce
            )
        )

    async def SignalMachine(
        self, request: w.SignalMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.SignalMachineResponse:
        if not request.signal:
            raise InvalidArgument("signal", "is required")
        sig = parse_signal("signal", request.signal)
        if sig in FREEZING_SIGNALS:
            raise InvalidArgument(
                "signal",
                f"{signal.Signals(sig).name} would freeze the machine while it shows as "
                "started; stop it with StopMachine",
            )
        machine = await self.worker.signal(request.machine_id, sig, lease_nonce=request.lease_nonce)
        return w.SignalMachineResponse(machine=machine)

    async def DestroyMachine(
        self, request: w.DestroyMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.DestroyMachineResponse:
        return w.DestroyMachineResponse(
            machine=await self.worker.destroy(
                request.machine_id, request.force, lease_nonce=request.lease_nonce
            )
        )

    async def GetMachine(
        self, request: w.GetMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.GetMachineResponse:
        return w.GetMachineResponse(machine=self.worker.answer(request.machine_id))

    async def RevealSecrets(
        self, request: w.RevealSecretsRequest, context: grpc.aio.ServicerContext
    ) -> w.RevealSecretsResponse:
        # Only flaps' certificate gets here (flyd.access), copying an app's secrets to a new
        # machine of it. A flyd serving plaintext knows no caller: it has no secrets to keep
        # from anyone who can reach it, as with every other call.
        return w.RevealSecretsResponse(secrets=self.worker.reveal_secrets(request.machine_id))

    async def ListMachines(
        self, request: w.ListMachinesRequest, context: grpc.aio.ServicerContext
    ) -> w.ListMachinesResponse:
        if request.app:
            check_name("app", request.app)
        machines, next_token = page(
            self.worker.list_machines(
                app=request.app, state=request.state, include_destroyed=request.include_destroyed
            ),
            request.page_size,
            request.page_token,
        )
        return w.ListMachinesResponse(machines=machines, next_page_token=next_token)

    async def WaitMachine(
        self, request: w.WaitMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.WaitMachineResponse:
        timeout = duration_seconds(
            "timeout",
            request.timeout,
            default=DEFAULT_WAIT,
            maximum=MAX_WAIT,
            present=request.HasField("timeout"),
        )
        async with self.streams.hold(context, "WaitMachine calls", caller_name(context)):
            machine = await self.worker.wait(
                request.machine_id, request.state, timeout, request.instance_id, ready=request.ready
            )
        return w.WaitMachineResponse(machine=machine)

    async def GetCapacity(
        self, request: w.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> w.GetCapacityResponse:
        return w.GetCapacityResponse(worker=self.worker.info(), capacity=self.worker.capacity())

    async def WatchEvents(
        self, request: w.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[w.WatchEventsResponse]:
        async with self.streams.hold(context, "WatchEvents streams", caller_name(context)):
            async for item in self.worker.watch(
                request.from_seq,
                heartbeat_interval=self.heartbeat_interval,
                stop=self.draining,
                log_epoch=request.log_epoch,
            ):
                yield item

    async def GetMachineLogs(
        self, request: w.GetMachineLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[w.GetMachineLogsResponse]:
        if request.tail_lines < 0 or request.tail_lines > MAX_TAIL:
            raise InvalidArgument("tail_lines", f"must be between 0 and {MAX_TAIL}")
        self.worker.get(request.machine_id)
        if not request.follow:
            for item in (await self._log_tail(request))[0]:
                yield item
            return
        async with self.streams.hold(
            context, "GetMachineLogs follow streams", caller_name(context)
        ):
            items, follow_from = await self._log_tail(request)
            for item in items:
                yield item
            # From where the tail's read ended: a line written in between is not lost.
            async for line in self.worker.driver.follow_logs(
                request.machine_id, shutdown=self.draining, from_offset=follow_from
            ):
                yield w.GetMachineLogsResponse(line=line[:MAX_LINE])

    async def _log_tail(
        self, request: w.GetMachineLogsRequest
    ) -> tuple[list[w.GetMachineLogsResponse], int | None]:
        """The tail a GetMachineLogs starts with, and where a follow goes on from: read off
        the loop, at most `log_read_bytes` of the log; the first line says how much of the
        log before it was left out."""
        tail = await self.worker.runner.read_logs(
            request.machine_id, request.tail_lines or 100, self.log_read_bytes
        )
        # A line is cut to fit a message, whatever the machine printed without a newline.
        items = [w.GetMachineLogsResponse(line=line[:MAX_LINE]) for line in tail.lines]
        if items:
            items[0].truncated_bytes = tail.truncated_bytes
        return items, tail.follow_from

    async def CordonWorker(
        self, request: w.CordonWorkerRequest, context: grpc.aio.ServicerContext
    ) -> w.CordonWorkerResponse:
        return w.CordonWorkerResponse(cordoned=self.worker.cordon(request.cordoned))

    async def UpdateMachine(
        self, request: w.UpdateMachineRequest, context: grpc.aio.ServicerContext
    ) -> w.UpdateMachineResponse:
        machine = await self.worker.update(
            request.machine_id,
            request.config,
            skip_launch=request.skip_launch,
            lease_nonce=request.lease_nonce,
        )
        return w.UpdateMachineResponse(machine=machine)

    async def AcquireLease(
        self, request: w.AcquireLeaseRequest, context: grpc.aio.ServicerContext
    ) -> w.AcquireLeaseResponse:
        ttl = duration_seconds(
            "ttl", request.ttl, default=0, maximum=MAX_LEASE, present=request.HasField("ttl")
        )
        if ttl < 1:
            raise InvalidArgument("ttl", "must be at least 1s")
        lease = await self.worker.acquire_lease(
            request.machine_id,
            ttl=ttl,
            owner=request.owner,
            description=request.description,
            nonce=request.nonce,
        )
        return w.AcquireLeaseResponse(lease=lease)

    async def ReleaseLease(
        self, request: w.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> w.ReleaseLeaseResponse:
        await self.worker.release_lease(request.machine_id, request.nonce)
        return w.ReleaseLeaseResponse()

    async def ListMachineEvents(
        self, request: w.ListMachineEventsRequest, context: grpc.aio.ServicerContext
    ) -> w.ListMachineEventsResponse:
        return w.ListMachineEventsResponse(events=list(self.worker.events(request.machine_id)))

    async def GetPlacement(
        self, request: w.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> w.GetPlacementResponse:
        return w.GetPlacementResponse(placement=self.worker.placement(request.machine_id))
