"""A fake worker for tests and benchmarks: flyd's WatchEvents and GetCapacity, nothing else.

`FakeWorker` keeps a log of machine changes in memory and serves it the way flyd does: a
snapshot first when asked from seq 0, the changes after `from_seq` otherwise, then live changes
and heartbeats. It runs no machines, so a hundred of them fit in one process. Heartbeats go out
every `heartbeat_interval` real seconds, or, with `heartbeat_interval=None`, only when the test
calls `beat()`. `serve()` puts it on a real gRPC port so a Replica follows it like any flyd.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w

S = pb.MachineState
_QUEUE = 4096
_BEAT = object()


class FakeWorker:
    """An in-memory worker log served over WatchEvents; `change()` commits one change.

    Only GetCapacity and WatchEvents are served; every other WorkerService RPC answers
    UNIMPLEMENTED.
    """

    def __init__(
        self,
        worker_id: str,
        region: str = "local",
        *,
        heartbeat_interval: float | None = 0.2,
        boot_id: str | None = None,
    ) -> None:
        self.info = pb.WorkerInfo(
            id=worker_id, region=region, boot_id=boot_id or secrets.token_hex(8)
        )
        self.heartbeat_interval = heartbeat_interval
        self.capacity = pb.Capacity(
            total=pb.Resources(cpu_millicores=4000, memory_mib=4096, machines=100),
            free=pb.Resources(cpu_millicores=4000, memory_mib=4096, machines=100),
        )
        self.changes: list[w.MachineChange] = []
        self.rows: dict[str, pb.Machine] = {}
        self.watch_requests: list[int] = []
        """`from_seq` of every WatchEvents call, in order."""
        self._subscribers: set[asyncio.Queue[object]] = set()
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Event()

    @property
    def seq(self) -> int:
        return len(self.changes)

    @property
    def streams(self) -> int:
        """How many WatchEvents streams are open."""
        return len(self._subscribers)

    @property
    def address(self) -> str:
        return self.info.address

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds, re-checked whenever a stream opens or closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    def _touch(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- the log -------------------------------------------------------------------------------

    def change(
        self,
        machine_id: str,
        state: pb.MachineState.ValueType = S.MACHINE_STATE_CREATED,
        *,
        app: str = "app",
        op: str = "update",
        at: float | None = None,
    ) -> w.MachineChange:
        """Commit one change: `machine_id` is now in `state`. `at` (default now) is its time."""
        seq = self.seq + 1
        old = self.rows.get(machine_id)
        machine = pb.Machine(
            id=machine_id,
            name=machine_id,
            app=app,
            region=self.info.region,
            worker_id=self.info.id,
            state=state,
            instance_id="i1",
        )
        machine.updated_at.FromNanoseconds(int((time.time() if at is None else at) * 1e9))
        event = pb.MachineEvent(
            seq=seq,
            machine_id=machine_id,
            type=op,
            from_state=old.state if old is not None else S.MACHINE_STATE_UNSPECIFIED,
            to_state=state,
            time=machine.updated_at,
        )
        machine.events.append(event)
        change = w.MachineChange(event=event, machine=machine)
        self.changes.append(change)
        self.rows[machine_id] = machine
        for queue in self._subscribers:
            queue.put_nowait(change)
        return change

    def beat(self) -> None:
        """Send one heartbeat on every open stream now."""
        for queue in self._subscribers:
            queue.put_nowait(_BEAT)

    def heartbeat(self) -> w.Heartbeat:
        hb = w.Heartbeat(seq=self.seq, worker=self.info, capacity=self.capacity)
        hb.time.FromNanoseconds(time.time_ns())
        return hb

    def snapshot(self) -> w.Snapshot:
        return w.Snapshot(seq=self.seq, machines=self.rows.values(), reason="requested")

    # -- WorkerService -------------------------------------------------------------------------

    async def GetCapacity(
        self, request: w.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> w.GetCapacityResponse:
        return w.GetCapacityResponse(worker=self.info, capacity=self.capacity)

    async def WatchEvents(
        self, request: w.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[w.WatchEventsResponse]:
        from_seq = request.from_seq
        self.watch_requests.append(from_seq)
        self._touch()
        if from_seq > self.seq:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"from_seq: {from_seq} is ahead of this worker's log ({self.seq})",
            )
        queue: asyncio.Queue[object] = asyncio.Queue(_QUEUE)
        self._subscribers.add(queue)
        self._touch()
        try:
            # No await before the snapshot or replay is built: the queue starts where they end.
            if from_seq == 0:
                first = [w.WatchEventsResponse(snapshot=self.snapshot())]
            else:
                first = [w.WatchEventsResponse(change=c) for c in self.changes[from_seq:]]
            for item in first:
                yield item
            if self.heartbeat_interval is not None:
                yield w.WatchEventsResponse(heartbeat=self.heartbeat())
            loop = asyncio.get_running_loop()
            next_beat = loop.time() + (self.heartbeat_interval or 0.0)
            while True:
                timeout = None
                if self.heartbeat_interval is not None:
                    timeout = max(0.0, next_beat - loop.time())
                try:
                    queued = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    queued = _BEAT
                    next_beat = loop.time() + (self.heartbeat_interval or 0.0)
                if queued is _BEAT:
                    yield w.WatchEventsResponse(heartbeat=self.heartbeat())
                else:
                    assert isinstance(queued, w.MachineChange)
                    yield w.WatchEventsResponse(change=queued)
        finally:
            self._subscribers.discard(queue)
            self._touch()

    # -- serving -------------------------------------------------------------------------------

    async def serve(self, listen: str = "127.0.0.1:0") -> str:
        """Serve on `listen` (again after `stop`, e.g. on the same port); returns the address."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handlers = {
            "GetCapacity": grpc.unary_unary_rpc_method_handler(
                self.GetCapacity,
                request_deserializer=w.GetCapacityRequest.FromString,
                response_serializer=w.GetCapacityResponse.SerializeToString,
            ),
            "WatchEvents": grpc.unary_stream_rpc_method_handler(
                self.WatchEvents,
                request_deserializer=w.WatchEventsRequest.FromString,
                response_serializer=w.WatchEventsResponse.SerializeToString,
            ),
        }
        service = w.DESCRIPTOR.services_by_name["WorkerService"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        port = server.add_insecure_port(listen)
        if not port:
            raise RuntimeError(f"could not bind {listen}")
        await server.start()
        self._server = server
        self.info.address = f"{listen.rpartition(':')[0]}:{port}"
        return self.info.address

    async def stop(self) -> None:
        """Stop serving at once, cutting every stream (a crash, as followers see it)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
