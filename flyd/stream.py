"""The worker's changes as others read them: WatchEvents streams, waits, and the log's history.

The runner publishes every committed MachineChange here. A watcher replays the log from its
position (or starts from a snapshot), then follows live changes through a bounded queue,
with heartbeats between them; one that falls too far behind, or behind a compaction, catches
up from the log or a new snapshot (in parts: model.pages). Waiters (WaitMachine) wake on each
published change.

Before each heartbeat the worker may commit changes of its own (`before_heartbeat`: the fences
of a worker that was away, flyd.fencing); those go out first, so a follower never hears the
worker alive again before it hears of the fences. A follower names the log its position counts
in (`log_epoch`); a position in another log (the worker's data was wiped) gets a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from flyd import fsm
from flyd.store import Compacted, MachineLog
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model.errors import InvalidArgument
from model.pages import snapshot_parts

# A subscriber further behind than this many changes catches up from the log instead.
SUBSCRIBER_QUEUE = 4096
_LAGGED = object()


class EventStream:
    """Fans committed changes out to watchers and waiters; reads the log for the rest."""

    def __init__(self, store: MachineLog, heartbeat: Callable[[], worker_pb2.Heartbeat]) -> None:
        """`heartbeat`: the worker's heartbeat, sent to watchers between changes."""
        self.store = store
        self._heartbeat = heartbeat
        self._subscribers: set[asyncio.Queue[object]] = set()
        self._tick: asyncio.Future[None] | None = None
        self.closed = False
        self.before_heartbeat: Callable[[], Awaitable[bool]] | None = None
        """Run before each heartbeat; True when it committed changes that must go out first."""

    def close(self) -> None:
        """End every watch (waits run on to their own deadlines)."""
        self.closed = True
        for q in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)

    def publish(self, change: worker_pb2.MachineChange) -> None:
        """Hand one committed change to every watcher and wake every waiter."""
        for q in self._subscribers:
            try:
                q.put_nowait(change)
            except asyncio.QueueFull:
                # Too far behind: drop what is queued; it re-reads from the log.
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(_LAGGED)
        if self._tick is not None and not self._tick.done():
            self._tick.set_result(None)
        self._tick = None

    async def changed(self, timeout: float) -> None:
        """Return at the next published change, or after `timeout` seconds."""
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
        # arrives as the awaited change does, and the caller then waits on to its deadline.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._tick)

    def snapshot(self, reason: str) -> list[worker_pb2.WatchEventsResponse]:
        """Every row at the log's last seq, as the stream items of a snapshot in parts."""
        snap = self.store.snapshot()
        machines = (fsm.decode_row(raw).machine for raw in snap.rows.values())
        epoch = self.store.epoch()
        out = []
        for part in snapshot_parts(snap.seq, reason, machines):
            part.log_epoch = epoch
            out.append(worker_pb2.WatchEventsResponse(snapshot=part))
        return out

    async def watch(
        self,
        from_seq: int,
        *,
        heartbeat_interval: float,
        stop: asyncio.Event,
        log_epoch: str = "",
    ) -> AsyncIterator[worker_pb2.WatchEventsResponse]:
        """Every change after from_seq (or a snapshot first), then live, with heartbeats.

        `log_epoch` is the log from_seq counts in ("" when the follower does not know): a
        position in another log starts with a snapshot (reason "epoch")."""
        reason = "requested"
        if from_seq and log_epoch and log_epoch != self.store.epoch():
            from_seq, reason = 0, "epoch"
        if from_seq > self.store.last_seq():
            raise InvalidArgument(
                "from_seq", f"{from_seq} is ahead of this worker's log ({self.store.last_seq()})"
            )
        queue: asyncio.Queue[object] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        try:
            pos = from_seq
            if from_seq == 0:
                for item in self.snapshot(reason):
                    pos = item.snapshot.seq
                    yield item
            loop = asyncio.get_running_loop()
            next_beat = loop.time()
            caught_up = False
            while not stop.is_set() and not self.closed:
                if not caught_up:
                    try:
                        async for item in self._replay(pos):
                            yield item
                            pos = item.change.event.seq
                    except Compacted:
                        for item in self.snapshot("compacted"):
                            pos = item.snapshot.seq
                            yield item
                        continue
                    caught_up = True
                if loop.time() >= next_beat:
                    if self.before_heartbeat is not None and await self.before_heartbeat():
                        caught_up = False  # what it committed goes out before the heartbeat
                        continue
                    yield worker_pb2.WatchEventsResponse(heartbeat=self._heartbeat())
                    next_beat = loop.time() + heartbeat_interval
                if not queue.empty():  # (no timer to set and cancel for a change at hand)
                    queued = queue.get_nowait()
                else:
                    try:
                        # asyncio.timeout, not wait_for: see changed().
                        async with asyncio.timeout(max(0.0, next_beat - loop.time())):
                            queued = await queue.get()
                    except TimeoutError:
                        continue
                if queued is None:
                    return
                if queued is _LAGGED:
                    caught_up = False
                    continue
                assert isinstance(queued, worker_pb2.MachineChange)
                seq = queued.event.seq
                if seq <= pos:
                    continue
                if seq != pos + 1:
                    caught_up = False  # a gap: read it from the log
                    continue
                pos = seq
                yield worker_pb2.WatchEventsResponse(change=queued)
        finally:
            self._subscribers.discard(queue)

    async def _replay(self, after: int) -> AsyncIterator[worker_pb2.WatchEventsResponse]:
        while batch := self.store.read(after, 500):
            for rec in batch:
                change = worker_pb2.MachineChange.FromString(rec.body)
                yield worker_pb2.WatchEventsResponse(change=change)
                after = rec.seq
            await asyncio.sleep(0)  # let others run during a long replay

    def events(self, machine_id: str) -> Iterator[pb.MachineEvent]:
        """The machine's state changes still in the log, oldest first."""
        after = self.store.first_seq() - 1
        while batch := self.store.read(after, 1000):
            for rec in batch:
                change = worker_pb2.MachineChange.FromString(rec.body)
                if change.event.machine_id == machine_id:
                    yield change.event
                after = rec.seq
