"""registry.v1.RegistryService over gRPC, and the one place registry errors become status codes.

Any service that embeds a replica serves it with `serve_replica(service, replica, workers)`:
over TLS, each call checked against the replica's role table (registry.access).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable, Iterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from model.pages import PAGE_BYTES
from registry.access import REGISTRY_ACCESS
from registry.errors import InvalidArgument, RegistryError, Unavailable
from registry.replica import (
    APPLY_SLICE,
    FOLLOW_BATCH,
    FOLLOW_QUEUE,
    FOLLOW_RESYNC,
    Replica,
    SubscriptionClosed,
)
from registry.settings import FOLLOWS_PER_CALLER, ReplicaSettings
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from runtime import Service, access
from runtime.streams import CallerCaps, caller_name
from runtime.validate import check_name

REASON_DOMAIN = "registry.nonomad"

# Checked in order: the first matching class decides (subclasses before their bases).
_CODES: list[tuple[type[RegistryError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def map_error(err: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The registry's errors as gRPC statuses; None for anything else (reported as INTERNAL)."""
    if not isinstance(err, RegistryError):
        return None
    for cls, code in _CODES:
        if isinstance(err, cls):
            return code, str(err)
    return grpc.StatusCode.UNAVAILABLE, str(err)  # a SequenceGap: try again


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """Thin translation between requests and the Replica.

    `draining` (the embedding Service's `draining` event) ends Follow streams when shutdown
    begins, so that stopping the server need not wait out its grace period; without it they
    end when the replica stops. `follow_queue` bounds what each Follow stream may have queued:
    a downstream further behind is sent a fresh snapshot instead. `follows_per_caller`: how
    many Follow streams one caller may have open; one more is RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        replica: Replica,
        *,
        draining: asyncio.Event | None = None,
        follow_queue: int = FOLLOW_QUEUE,
        follows_per_caller: int = FOLLOWS_PER_CALLER,
    ) -> None:
        self.replica = replica
        self.draining = draining
        self.follow_queue = follow_queue
        self.follows = CallerCaps(
            limit=follows_per_caller, setting="--follows-per-caller", domain=REASON_DOMAIN
        )

    async def Announce(
        self, request: r.AnnounceRequest, context: grpc.aio.ServicerContext
    ) -> r.AnnounceResponse:
        if not request.HasField("worker"):
            raise InvalidArgument("worker", "is required")
        self.replica.add_worker(request.worker)
        return r.AnnounceResponse(workers=[view.info for view in self.replica.workers()])

    async def ListMembers(
        self, request: r.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> r.ListMembersResponse:
        members = []
        for view in self.replica.workers():
            member = r.Member(
                worker=view.info, status=view.status, seq=view.seq, capacity=view.capacity
            )
            if view.last_heartbeat:
                member.last_heartbeat.CopyFrom(_timestamp(view.last_heartbeat))
            members.append(member)
        return r.ListMembersResponse(members=members)

    async def ListSlot(
        self, request: r.ListSlotRequest, context: grpc.aio.ServicerContext
    ) -> r.ListSlotResponse:
        check_name("app", request.app)
        check_name("slot", request.slot)
        return r.ListSlotResponse(
            members=[
                r.SlotMember(machine=machine, worker=view.info, status=view.status)
                for machine, view in self.replica.slot(request.app, request.slot)
            ]
        )

    async def Follow(
        self, request: r.FollowRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[r.FollowResponse, None]:
        async with self.follows.hold(context, "Follow streams", caller_name(context)):
            async for message in self.feed(request):
                yield message

    async def feed(self, request: r.FollowRequest) -> AsyncGenerator[r.FollowResponse, None]:
        """What a Follow stream sends: the view, then each change (`Follow` counts the stream
        against its caller's cap first)."""
        # The feed starts before the view is read: what it queues meanwhile is newer than, or
        # a repeat of, the snapshots (built one worker at a time, between yields).
        feed = self.replica.follow(self.follow_queue)
        items: Iterable[r.FollowResponse] = self.replica.follow_items()
        most = max(1, min(request.max_batch, FOLLOW_BATCH))
        drained = None
        if self.draining is not None:
            drained = asyncio.ensure_future(self.draining.wait())
            drained.add_done_callback(lambda _: feed.close())
        try:
            while True:
                for message in _batches(items, most):
                    yield message
                try:
                    got = await feed.get()
                except SubscriptionClosed:
                    raise Unavailable("the registry replica is shutting down") from None
                if got is FOLLOW_RESYNC:
                    # Too far behind: start over from the current view, not an unbounded queue.
                    feed.clear()
                    items = self.replica.follow_items()
                    continue
                # What else is queued goes in the same message (up to the follower's batch).
                ready = [got]
                while len(ready) < most:
                    more = feed.peek()
                    if more is None or more is FOLLOW_RESYNC:
                        break
                    feed.get_nowait()
                    ready.append(more)
                items = ready
        finally:
            feed.close()
            if drained is not None:
                drained.cancel()


def _batches(items: Iterable[r.FollowResponse], most: int) -> Iterator[r.FollowResponse]:
    """`items` as Follow messages of up to `most` items and `PAGE_BYTES` (snapshot parts are
    up to that large): one item alone as itself, several in `batch`. Lazily, and a message goes
    once its items took `APPLY_SLICE` to build (the view's snapshots are built as the stream
    goes): the loop runs something else between messages."""
    if most == 1:
        yield from items
        return
    ready: list[r.FollowResponse] = []
    size = 0
    due = time.perf_counter() + APPLY_SLICE
    for item in items:
        cost = item.ByteSize()
        if ready and (len(ready) == most or size + cost > PAGE_BYTES or time.perf_counter() > due):
            yield ready[0] if len(ready) == 1 else r.FollowResponse(batch=ready)
            ready, size = [], 0
            due = time.perf_counter() + APPLY_SLICE
        ready.append(item)
        size += cost
    if ready:
        yield ready[0] if len(ready) == 1 else r.FollowResponse(batch=ready)


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def serve_replica(service: Service, replica: Replica, workers: Iterable[str]) -> None:
    """Serve `replica` as `registry.v1.RegistryService` from `service` (workers announce
    themselves to it, replicas share members with it), follow the seed `workers`, and run it
    while the service runs. Over TLS, for the cluster's parts only, as far as their roles go
    (registry.access), on every port the service has."""
    settings = service.settings
    servicer = RegistryServicer(
        replica,
        draining=service.draining,
        follows_per_caller=settings.follows_per_caller
        if isinstance(settings, ReplicaSettings)
        else FOLLOWS_PER_CALLER,
    )
    access.add(
        service,
        REGISTRY_ACCESS,
        servicer,
        registry_pb2_grpc.add_RegistryServiceServicer_to_server,
        r.DESCRIPTOR.services_by_name["RegistryService"],
        map_error,
    )
    for address in workers:
        replica.add_address(address)
    service.spawn("replica", replica.run)
