"""The registry replica ("our Corrosion"): a read view of every worker and machine.

flaps and proxy embed a `Replica`; `registry.main` runs one on its own. A replica follows each
worker's WatchEvents stream from the last seq it applied (or, in upstream mode, one other
replica's Follow stream), judges liveness from heartbeat age on an injected clock, and learns of
workers joining at runtime from Announce calls and from its peers' membership. Every row has one
writer, the worker that owns it, so replicas never conflict: this is replication, not agreement.

The state lives in a pure `registry.view.View`; this module runs the loops around it and tells
subscribers what changed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
import structlog
from google.protobuf.message import DecodeError

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2, worker_pb2_grpc
from model.slots import slot_of
from registry import metrics
from registry.errors import InvalidArgument, LogRestarted, RegistryError, Unavailable
from registry.rows import MachineQuery
from registry.supply import Supply
from registry.v1 import registry_pb2, registry_pb2_grpc
from registry.view import (
    ALIVE,
    DEAD,
    RESYNC,
    Doubt,
    ReplicaEvent,
    Row,
    View,
    WorkerView,
    check_worker_info,
    status_name,
)
from runtime import aio_channel, parse_host_port
from runtime.clock import Clock, SystemClock

__all__ = [
    "FOLLOW_BATCH",
    "FOLLOW_RESYNC",
    "RESYNC",
    "Replica",
    "ReplicaEvent",
    "Subscription",
    "SubscriptionClosed",
    "WorkerView",
    "check_worker_info",
    "event_key",
    "status_name",
]

log = structlog.get_logger("registry.replica")

T = TypeVar("T")

# Reconnect backoff starts here and doubles up to `retry_max`.
RETRY_MIN = 0.05
# How often liveness is re-judged (on the injected clock).
LIVENESS_TICK = 0.05
# How often each peer is asked for its members, and the deadline of that call.
MEMBERSHIP_INTERVAL = 1.0
RPC_TIMEOUT = 2.0
# A worker's stream without a heartbeat for this long (on the clock) is torn down and reopened:
# a frozen worker or a half-open connection must not hold a follower until keepalive (~40 s)
# notices. The upstream stream relies on keepalive alone: it is quiet whenever no worker beats.
MIN_STREAM_IDLE = 2.0
# Items a Follow stream may queue for its downstream before it is resynced from a snapshot.
FOLLOW_QUEUE = 4096
# How long the upstream stream may apply items it already has before it lets the loop run
# something else: a burst of thousands of heartbeats must not hold every other call up. A call
# waits up to a slice at each of its steps on the loop (a few per RPC), and a yield costs
# about a microsecond: short slices are cheap.
APPLY_SLICE = 0.0001
# Items a Follow message may carry (FollowRequest.max_batch): what a downstream asks of its
# upstream, and the most an upstream sends in one message. Per message, gRPC costs each end
# some 100 us; applying a heartbeat, a tenth of that.
FOLLOW_BATCH = 256


FollowRequest = registry_pb2.FollowRequest
FollowResponse = registry_pb2.FollowResponse
FOLLOW_METHOD = "/registry.v1.RegistryService/Follow"
# FollowResponse.batch: field 5, length-delimited.
_BATCH_FIELD = 5


def follow_items(message: bytes) -> Iterator[bytes]:
    """The items of a serialized Follow message, each still serialized: those of its `batch`,
    or the message itself when it has none (as `message.batch or (message,)` reads it). Only
    the framing is read here, so a caller parses one item at a time."""
    items: list[bytes] = []
    view = memoryview(message)
    i, end = 0, len(message)
    while i < end:
        tag, i = _varint(message, i)
        wire = tag & 7
        if wire == 0:
            _, i = _varint(message, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            size, i = _varint(message, i)
            if tag >> 3 == _BATCH_FIELD:
                items.append(bytes(view[i : i + size]))
            i += size
        else:
            raise DecodeError(f"wire type {wire} in a Follow message")
        if i > end:
            raise DecodeError("a Follow message ends inside a field")
    return iter(items) if items else iter((message,))


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise DecodeError("a Follow message ends inside a varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


async def _yield_fairly() -> None:
    """Let the loop run what is waiting, timers included. A timer that came due while we ran
    queues its callback behind our own wake-up, so one yield would let it run only after our
    next slice (a 1 ms timer saw two slices); the second puts us behind it."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def event_key(event: ReplicaEvent) -> Hashable:
    """What a later event replaces: the same machine's, or the same worker's."""
    return (event.kind, event.machine_id or event.worker_id)


class SubscriptionClosed(Unavailable):
    """The subscription was closed (by its holder, or because the replica stopped)."""


class Subscription(Generic[T]):
    """A bounded queue of one subscriber's items, filled by the replica.

    When the subscriber falls `maxsize` items behind, everything queued is dropped and a single
    `marker` (for `Replica.subscribe`: `RESYNC`, kind "resync") takes its place: the subscriber
    must re-read the view, and memory stays bounded however slow it is. With `key`, it keeps
    instead the latest item of each key (what `key(item)` names: a machine, a worker) until it
    has caught up: the subscriber reads what changed, once each, and never the whole view
    again; memory is then bounded by what the view holds. Iterate it with `async for` (ends
    when closed) or call `get()`; close it with `close()` or `async with`.
    """

    def __init__(
        self,
        maxsize: int,
        marker: T,
        on_close: Callable[[Subscription[T]], None] | None = None,
        key: Callable[[T], Hashable] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self.marker = marker
        self.overflows = 0
        """How many times the subscriber fell behind (and got the marker, or coalesced)."""
        self._items: collections.deque[T] = collections.deque()
        self._key = key
        self._latest: dict[Hashable, T] | None = None  # coalescing, when behind (with `key`)
        self._ready = asyncio.Event()
        self._closed = False
        self._on_close = on_close

    def put(self, item: T) -> None:
        """Queue `item`; on overflow replace the queue with the marker, or coalesce it. Never
        blocks."""
        if self._closed:
            return
        if self._latest is None and len(self._items) >= self.maxsize:
            self.overflows += 1
            if self._key is None:
                self._items.clear()
                self._items.append(self.marker)
            else:
                self._latest = {}
                for queued in self._items:
                    self._latest[self._key(queued)] = queued
                self._items.clear()
        if self._latest is not None:
            assert self._key is not None
            self._latest[self._key(item)] = item
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> T:
        """The next item; raises SubscriptionClosed once closed and drained."""
        while not self._items and not self._latest:
            if self._closed:
                raise SubscriptionClosed("subscription closed")
            self._ready.clear()
            await self._ready.wait()
        got = self.get_nowait()
        assert got is not None
        return got

    def get_nowait(self) -> T | None:
        """The next item, or None when nothing is queued."""
        if self._items:
            return self._items.popleft()
        if self._latest:
            item = self._latest.pop(next(iter(self._latest)))
            if not self._latest:
                self._latest = None  # caught up: a queue again
            return item
        return None

    def peek(self) -> T | None:
        """The next item, left queued; None when nothing is."""
        if self._items:
            return self._items[0]
        return next(iter(self._latest.values())) if self._latest else None

    def clear(self) -> None:
        """Drop everything queued (the holder is about to re-read the whole view)."""
        self._items.clear()
        self._latest = None

    def close(self) -> None:
        """Stop receiving; a pending `get` drains what is queued, then raises."""
        if self._closed:
            return
        self._closed = True
        self._ready.set()
        if self._on_close is not None:
            self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items) + len(self._latest or ())

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.get()
        except SubscriptionClosed:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Subscription[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


# The marker a Follow feed gets when it overflows (compared by identity).
FOLLOW_RESYNC = registry_pb2.FollowResponse()


class Replica:
    """A read view of workers and their machines, kept by following event streams.

    Build it, `add_worker`/`add_address` what you know, `await run(shutdown)` as a background
    task; read with `workers`, `machines`, ...; be told of changes with `subscribe` or
    `wait_for`. Returned machines and infos are the replica's own messages, replaced (never
    changed) by later updates: read them, do not modify them.

    `upstream` (host:port of another replica): follow its Follow stream instead of every
    worker, taking liveness from it. `peers`: replicas (registry, flaps or proxy) whose members
    are merged in every second, so a worker announced to any of them is followed everywhere.
    """

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        suspect_after: float = 0.6,
        dead_after: float = 1.0,
        channel: Callable[[str], grpc.aio.Channel] = aio_channel,
        upstream: str | None = None,
        peers: Sequence[str] = (),
        retry_max: float = 2.0,
        forget_after: float = 600.0,
    ) -> None:
        self._view = View(
            suspect_after=suspect_after,
            dead_after=dead_after,
            upstream=upstream is not None,
            forget_after=forget_after,
        )
        if not retry_max >= RETRY_MIN:
            raise ValueError(f"retry_max must be at least {RETRY_MIN}s, got {retry_max!r}")
        for name, address in [("upstream", upstream), *(("peers", p) for p in peers)]:
            if address is not None:
                try:
                    parse_host_port(address)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.upstream = upstream
        self.peers = tuple(peers)
        self.retry_max = retry_max
        self._channel = channel
        # Seconds without a heartbeat after which a worker's stream is reopened.
        self._stream_idle = max(MIN_STREAM_IDLE, 2 * dead_after)
        # Open streams: worker id -> (the follower task streaming, clock time of its last sign
        # of life: opening, or a heartbeat), the longest silent first.
        self._streams: collections.OrderedDict[str, tuple[asyncio.Task[Any] | None, float]] = (
            collections.OrderedDict()
        )
        # In the order they subscribed (dicts, not sets): each event reaches them in that
        # order, so which subscriber's task wakes first does not hang on memory addresses.
        self._subscribers: dict[Subscription[ReplicaEvent], None] = {}
        self._feeds: dict[Subscription[registry_pb2.FollowResponse], None] = {}
        # Set (and dropped) on the next change; made only when someone waits for one, not
        # for each of thousands of heartbeats a second.
        self._changed: asyncio.Event | None = None
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending_addresses: list[str] = []
        self._pending_announces: list[pb.WorkerInfo] = []
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self._running = False
        self._stopped = False

    # -- learning of workers -----------------------------------------------------------------

    def add_worker(self, info: pb.WorkerInfo) -> bool:
        """Learn of a worker and follow it; True if it was new.

        An existing id with a new address or boot id is updated and followed again at once.
        Raises InvalidArgument (naming `worker.id`, `worker.region`, `worker.address`) for a
        malformed info. In upstream mode the worker is announced to the upstream instead.
        """
        added = self._view.add(info, self.clock.now())
        self._publish(added.events)
        if added.refollow:
            if self.upstream is None:
                self._start_follower(info.id)
            else:
                self._announce_upstream(info)
        return added.new

    def add_address(self, address: str) -> None:
        """Learn of a worker by address alone: ask it who it is (GetCapacity, retried with
        backoff until it answers or the replica stops), then follow it at that address."""
        try:
            parse_host_port(address)
        except ValueError as err:
            raise InvalidArgument("address", str(err)) from None
        if self._running:
            self._spawn(self._resolve(address), f"resolve {address}")
        elif not self._stopped:
            self._pending_addresses.append(address)

    # -- reads ---------------------------------------------------------------------------------

    def workers(self, region: str | None = None) -> list[WorkerView]:
        """Every known worker (dead ones too: filter on `status`), optionally of one region."""
        return self._view.workers(region)

    def worker(self, worker_id: str) -> WorkerView | None:
        return self._view.worker(worker_id)

    def oldest_news(self, limit: int) -> list[tuple[str, float]]:
        """The `limit` workers (not dead) heard from longest ago, with when (View.oldest_news)."""
        return self._view.oldest_news(limit)

    def worker_page(
        self, region: str | None, after: str, limit: int
    ) -> tuple[list[WorkerView], str]:
        """A page of workers by id (see `View.worker_page`)."""
        return self._view.worker_page(region, after, limit)

    def regions(self) -> set[str]:
        return self._view.regions()

    def machines(
        self, *, app: str | None = None, region: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]:
        """Machine rows matching every filter given; destroyed rows included (filter on state)."""
        return self._view.machines(app=app, region=region, worker_id=worker_id)

    def machine_page(self, query: MachineQuery) -> tuple[list[pb.Machine], str]:
        """A page of machines and the next page's token (`View.machine_page`): costs the
        page, not the app's or the fleet's machines."""
        return self._view.machine_page(query)

    def machine(self, machine_id: str) -> pb.Machine | None:
        return self._view.machine(machine_id)

    def apps(self) -> dict[str, int]:
        """App name -> how many rows it has (destroyed ones still kept included)."""
        return self._view.apps()

    def slot(self, app: str, slot: str) -> list[tuple[pb.Machine, WorkerView]]:
        """The members of a slot (the app's rows whose slot is `slot`), each with its worker."""
        out = []
        for machine in self._view.machines(app=app):
            if slot_of(machine).id != slot:
                continue
            view = self._view.worker(machine.worker_id)
            if view is not None:
                out.append((machine, view))
        return out

    def row(self, machine_id: str) -> Row | None:
        """The machine's row as kept (app, state, bytes): no parse."""
        return self._view.row(machine_id)

    def owner(self, machine_id: str) -> str | None:
        """The worker that holds the machine's row."""
        return self._view.owner(machine_id)

    def by_key(self, app: str, key: str) -> pb.Machine | None:
        """The machine an idempotency key of the app created, if a row has it."""
        return self._view.by_key(app, key)

    def key_doubts(
        self, regions: Sequence[str], suffix: str, *, margin: float, give_up_after: float
    ) -> tuple[list[Doubt], list[Doubt]]:
        """`View.key_doubts` as of now: a worker's heartbeat vouches for it if it was sent at
        most `margin` seconds before now (the two clocks' time)."""
        now = self.clock.now()
        return self._view.key_doubts(
            regions, suffix, vouched_since=now - margin, now=now, give_up_after=give_up_after
        )

    @property
    def supply(self) -> Supply:
        """Every worker's free resources, liveness and machines per app, indexed for placement;
        kept up to date as items are applied. Read it between awaits."""
        return self._view.supply

    # -- being told ----------------------------------------------------------------------------

    def subscribe(
        self, maxsize: int = 1024, *, coalesce: bool = False
    ) -> Subscription[ReplicaEvent]:
        """Events for every change from now on; see `ReplicaEvent` and `Subscription`.

        A subscriber that falls `maxsize` events behind gets one `RESYNC` (re-read the view);
        with `coalesce`, the latest event of each machine and worker instead (re-read only what
        changed). Closed when the replica stops (a subscription made after that is closed at
        once).
        """
        sub: Subscription[ReplicaEvent] = Subscription(
            maxsize,
            RESYNC,
            lambda gone: self._subscribers.pop(gone, None),
            event_key if coalesce else None,
        )
        if self._stopped:
            sub.close()
        else:
            self._subscribers[sub] = None
        return sub

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` is true, re-checking after every applied change.

        Returns False if it is still false after `timeout` real seconds (a deadline on the
        wait, not replica time).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            changed = self._changed
            if changed is None:
                changed = self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return True

    def follow(self, maxsize: int = FOLLOW_QUEUE) -> Subscription[registry_pb2.FollowResponse]:
        """A feed of Follow stream items as they are applied (for `RegistryServicer.Follow`).

        Call `follow_items()` in the same step (no await between) for the state it starts
        from. On overflow the feed yields `FOLLOW_RESYNC`: clear it and start over from
        `follow_items()`.
        """
        feed: Subscription[registry_pb2.FollowResponse] = Subscription(
            maxsize, FOLLOW_RESYNC, lambda gone: self._feeds.pop(gone, None)
        )
        if self._stopped:
            feed.close()
        else:
            self._feeds[feed] = None
        return feed

    def follow_items(self) -> Iterator[registry_pb2.FollowResponse]:
        """The whole view as Follow items: each worker's snapshot and last heartbeat, built
        lazily (one worker at a time, so a stream can yield between them): every item the
        feed gets after `follow()` is newer than the snapshot it follows, or a repeat the
        downstream ignores by seq."""
        return self._view.follow_items()

    # -- running -------------------------------------------------------------------------------

    async def run(self, shutdown: asyncio.Event) -> None:
        """Follow, judge liveness and merge membership until `shutdown` is set.

        Then every loop and stream is cancelled and every subscription closed. Raises if a
        core loop (liveness, membership, upstream) fails: that is a bug, not weather.
        """
        if self._running or self._stopped:
            raise RuntimeError("a Replica runs only once")
        self._running = True
        metrics.track(self._view)
        core: list[asyncio.Task[None]] = []
        try:
            core.append(asyncio.create_task(self._liveness_loop(), name="registry/liveness"))
            if self.peers:
                core.append(
                    asyncio.create_task(self._membership_loop(), name="registry/membership")
                )
            if self.upstream is not None:
                core.append(asyncio.create_task(self._upstream_loop(), name="registry/upstream"))
                for info in self._pending_announces:
                    self._announce_upstream(info)
            else:
                for view in self._view.workers():
                    self._start_follower(view.info.id)
            for address in self._pending_addresses:
                self._spawn(self._resolve(address), f"resolve {address}")
            self._pending_addresses.clear()
            self._pending_announces.clear()
            waiter = asyncio.create_task(shutdown.wait())
            try:
                done, _ = await asyncio.wait({waiter, *core}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            for task in core:
                if task in done:
                    task.result()  # a core loop never returns on its own: raise why it did
        finally:
            self._stopped = True
            self._running = False
            metrics.untrack(self._view)
            tasks = [*core, *self._followers.values(), *self._tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._followers.clear()
            for channel in self._peer_channels.values():
                await channel.close()
            self._peer_channels.clear()
            for sub in list(self._subscribers):
                sub.close()
            for feed in list(self._feeds):
                feed.close()
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.set()  # (and kept: waiters re-check until their deadline)
            log.info("replica_stopped", workers=len(self._view))

    # -- publishing ----------------------------------------------------------------------------

    def _publish(
        self,
        events: list[ReplicaEvent],
        relayed: tuple[str, worker_pb2.WatchEventsResponse] | None = None,
    ) -> None:
        """Tell subscribers, feeds and waiters. `relayed`: the stream item that was applied."""
        if not events and relayed is None:
            return
        if self._feeds:
            items = []
            if relayed is not None:
                items.append(self._view.relay(*relayed))
            covered = relayed[0] if relayed is not None else None
            for worker_id in dict.fromkeys(
                e.worker_id for e in events if e.kind == "worker" and e.worker_id != covered
            ):
                items.append(self._view.relay(worker_id, None))
            for feed in list(self._feeds):
                for item in items:
                    feed.put(item)
        if events:
            for sub in list(self._subscribers):
                for event in events:
                    sub.put(event)
        changed = self._changed
        if changed is not None and not self._stopped:
            self._changed = None
            changed.set()

    def _apply(self, worker_id: str, item: worker_pb2.WatchEventsResponse) -> None:
        now = self.clock.now()
        applied = self._view.apply(worker_id, item, now)
        stream = self._streams.get(worker_id)
        if stream is not None and item.HasField("heartbeat"):
            # Relinked, not deleted and added: a dict of 10,000 streams churned 5,000 times a
            # second would be rebuilt (a millisecond or two) every couple of seconds.
            self._streams[worker_id] = (stream[0], now)
            self._streams.move_to_end(worker_id)
        if applied.relay:
            metrics.applied(worker_id, item, now)
        self._publish(applied.events, (worker_id, item) if applied.relay else None)

    def _set_connected(self, worker_id: str, connected: bool) -> None:
        self._publish(self._view.set_connected(worker_id, connected))

    # -- following workers ---------------------------------------------------------------------

    def _start_follower(self, worker_id: str) -> None:
        if not self._running:
            return  # run() starts one per known worker
        old = self._followers.pop(worker_id, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._follow_worker(worker_id), name=f"registry/{worker_id}")
        self._followers[worker_id] = task
        task.add_done_callback(lambda t: self._follower_done(worker_id, t))

    def _follower_done(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._followers.get(worker_id) is task:
            del self._followers[worker_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("follower_crashed", worker=worker_id, exc_info=task.exception())

    async def _follow_worker(self, worker_id: str) -> None:
        """Follow one worker's stream for as long as the replica runs, resuming where it was."""
        backoff = RETRY_MIN
        while self._running:
            view = self._view.worker(worker_id)
            if view is None:
                return
            from_seq = self._view.resume_seq(worker_id)
            epoch = self._view.resume_epoch(worker_id)
            try:
                await self._stream_worker(worker_id, view.info.address, from_seq, epoch)
                reason = "stream ended"
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT and from_seq > 0:
                    # "from_seq is ahead of this worker's log": its log restarted from scratch.
                    self._view.reset(worker_id)
                    metrics.LOG_RESTARTS.inc()
                reason = f"{code.name}: {err.details()}"
            except LogRestarted as err:
                metrics.LOG_RESTARTS.inc()
                reason = str(err)
            except RegistryError as err:  # a gap, or the wrong worker at this address
                reason = str(err)
            except Exception as err:  # a bug must not stop this worker from being followed
                log.exception("follow_failed", worker=worker_id)
                reason = repr(err)
            view = self._view.worker(worker_id)
            dropped = view is not None and view.connected
            if dropped:
                backoff = RETRY_MIN  # it was a healthy stream: reconnect at once
            self._set_connected(worker_id, False)
            # A dead worker is retried every retry_max seconds: say so once, not every time.
            (log.info if dropped else log.debug)(
                "follow_retry", worker=worker_id, reason=reason, retry_in=backoff
            )
            await self._sleep(backoff)
            backoff = min(backoff * 2, self.retry_max)

    async def _stream_worker(
        self, worker_id: str, address: str, from_seq: int, log_epoch: str = ""
    ) -> None:
        """One WatchEvents stream, applied item by item until it ends or breaks."""
        me = asyncio.current_task()
        self._streams.pop(worker_id, None)
        self._streams[worker_id] = (me, self.clock.now())
        channel = self._channel(address)
        try:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            call = stub.WatchEvents(
                worker_pb2.WatchEventsRequest(from_seq=from_seq, log_epoch=log_epoch)
            )
            first = True
            async for item in call:
                if first:
                    first = False
                    log.info("following", worker=worker_id, address=address, from_seq=from_seq)
                    self._set_connected(worker_id, True)
                self._apply(worker_id, item)
        finally:
            if self._streams.get(worker_id, (None, 0.0))[0] is me:
                del self._streams[worker_id]
            await channel.close()

    async def _resolve(self, address: str) -> None:
        """Ask the worker at `address` who it is until it answers, then follow it there."""
        backoff = RETRY_MIN
        while self._running:
            channel = self._channel(address)
            try:
                resp = await worker_pb2_grpc.WorkerServiceStub(channel).GetCapacity(
                    worker_pb2.GetCapacityRequest(), timeout=RPC_TIMEOUT
                )
            except grpc.aio.AioRpcError as err:
                log.debug("resolve_retry", address=address, code=err.code().name, retry_in=backoff)
            else:
                info = pb.WorkerInfo()
                info.CopyFrom(resp.worker)
                info.address = address  # where we know it answers
                try:
                    self.add_worker(info)
                except InvalidArgument as err:
                    log.error("resolve_invalid_worker", address=address, error=str(err))
                return
            finally:
                await channel.close()
            await self._sleep(backoff)
            backoff = min(backoff * 2, self.retry_max)

    # -- liveness ------------------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        while self._running:
            now = self.clock.now()
            self._publish(self._view.tick(now))
            while self._view.due(now):  # a fleet gone quiet at once: a batch at a time
                await _yield_fairly()
                self._publish(self._view.tick(now))
            self._forget_dead(now)
            self._reopen_silent_streams(now)
            await self.clock.sleep_until(now + LIVENESS_TICK)

    def _forget_dead(self, now: float) -> None:
        events, gone = self._view.forget(now)
        for worker_id in gone:
            metrics.FORGOTTEN.inc()
            follower = self._followers.pop(worker_id, None)
            if follower is not None:
                follower.cancel()
            self._streams.pop(worker_id, None)
        self._publish(events)

    def _reopen_silent_streams(self, now: float) -> None:
        """Reopen the streams silent for too long: only the longest silent are looked at."""
        while self._streams:
            worker_id, (_, since) = next(iter(self._streams.items()))
            if now - since < self._stream_idle:
                return
            log.info("stream_silent", worker=worker_id, seconds=round(now - since, 3))
            del self._streams[worker_id]
            self._start_follower(worker_id)

    # -- membership ----------------------------------------------------------------------------

    async def _membership_loop(self) -> None:
        while self._running:
            await asyncio.gather(*(self._poll_peer(peer) for peer in self.peers))
            await self._sleep(MEMBERSHIP_INTERVAL)

    async def _poll_peer(self, peer: str) -> None:
        if peer not in self._peer_channels:
            self._peer_channels[peer] = self._channel(peer)
        channel = self._peer_channels[peer]
        try:
            resp = await registry_pb2_grpc.RegistryServiceStub(channel).ListMembers(
                registry_pb2.ListMembersRequest(), timeout=RPC_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            log.debug("peer_unreachable", peer=peer, code=err.code().name)
            # A fresh channel next time: grpc's own reconnect backoff grows to minutes.
            if self._peer_channels.get(peer) is channel:
                del self._peer_channels[peer]
            await channel.close()
            return
        self.merge_members(resp.members, source=peer)

    def merge_members(self, members: Sequence[registry_pb2.Member], source: str = "") -> int:
        """Learn of the workers a peer knows; returns how many were new or moved.

        Unknown workers are added. A known one is taken over from the peer only when we judge
        it dead and the peer sees it alive elsewhere (another address or boot id): a peer with
        stale info must not make two replicas flip a worker back and forth.
        """
        learned = 0
        for member in members:
            info = member.worker
            mine = self._view.worker(info.id)
            if mine is None and member.status == DEAD:
                continue  # (one we forgot, or would: not worth following)
            if mine is not None and not (
                mine.status == DEAD
                and member.status == ALIVE
                and (info.address != mine.info.address or info.boot_id != mine.info.boot_id)
            ):
                continue
            try:
                self.add_worker(info)
            except InvalidArgument as err:
                log.warning("peer_member_invalid", peer=source, worker=info.id, error=str(err))
                continue
            learned += 1
            log.info("member_learned", worker=info.id, peer=source, address=info.address)
        return learned

    # -- upstream mode -------------------------------------------------------------------------

    def _announce_upstream(self, info: pb.WorkerInfo) -> None:
        if not self._running:
            if not self._stopped:
                self._pending_announces.append(info)
            return
        self._spawn(self._forward_announce(info), f"announce {info.id}")

    async def _forward_announce(self, info: pb.WorkerInfo) -> None:
        assert self.upstream is not None
        channel = self._channel(self.upstream)
        try:
            await registry_pb2_grpc.RegistryServiceStub(channel).Announce(
                registry_pb2.AnnounceRequest(worker=info), timeout=RPC_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            # The worker announces itself again every few seconds; so does membership.
            log.warning("announce_upstream_failed", worker=info.id, code=err.code().name)
        finally:
            await channel.close()

    async def _upstream_loop(self) -> None:
        """Follow the upstream replica's Follow stream for as long as the replica runs."""
        assert self.upstream is not None
        backoff = RETRY_MIN
        while self._running:
            channel = self._channel(self.upstream)
            got_any = False
            try:
                # Messages as bytes, each item parsed as it is applied: a message of a MiB
                # of snapshots parsed at once held the loop for 3 ms.
                call = channel.unary_stream(FOLLOW_METHOD, FollowRequest.SerializeToString)(
                    registry_pb2.FollowRequest(max_batch=FOLLOW_BATCH)
                )
                loop = asyncio.get_running_loop()
                slice_end = loop.time() + APPLY_SLICE
                async for message in call:
                    if not got_any:
                        got_any = True
                        backoff = RETRY_MIN
                        log.info("following_upstream", upstream=self.upstream)
                    for data in follow_items(message):
                        if loop.time() > slice_end:
                            await _yield_fairly()
                            slice_end = loop.time() + APPLY_SLICE
                        resp = FollowResponse.FromString(data)
                        now = self.clock.now()
                        applied = self._view.apply_upstream(resp, now)
                        relayed = (resp.worker_id, resp.item) if resp.HasField("item") else None
                        if relayed is not None and applied.relay:
                            metrics.applied(*relayed, now)
                        self._publish(applied.events, relayed if applied.relay else None)
                reason = "ended"
            except grpc.aio.AioRpcError as err:
                reason = f"{err.code().name}: {err.details()}"
            except RegistryError as err:
                reason = str(err)
            except Exception as err:  # a bad item must not stop the replica for good
                log.exception("upstream_failed", upstream=self.upstream)
                reason = repr(err)
            finally:
                await channel.close()
            self._publish(self._view.disconnect_all())
            log.info("upstream_retry", upstream=self.upstream, reason=reason, retry_in=backoff)
            await self._sleep(backoff)
            backoff = min(backoff * 2, self.retry_max)

    # -- plumbing ------------------------------------------------------------------------------

    async def _sleep(self, seconds: float) -> None:
        await self.clock.sleep_until(self.clock.now() + seconds)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"registry/{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_crashed", task=task.get_name(), exc_info=task.exception())
