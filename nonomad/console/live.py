"""What changes, as it changes: the console's feed of events and its notices to open pages.

`Live` follows two streams and polls nothing:

- the console's registry replica, which follows flaps' (`Replica.follow()`: every machine
  change with its event, every heartbeat, every change of a worker's liveness as it is
  applied), turned into notices (a machine changed, a worker's capacity or status changed)
  and feed items (created, started, stopped, exited, failed, destroyed, promoted,
  superseded; a worker alive, suspect, dead, cordoned);
- flaps' placement decisions (`PlatformService.WatchPlacements`): placed, refused, a
  fallback to the next region.

The feed keeps the last `feed_size` items, numbered, so a page rendered with items up to n
asks its stream for those after n. Each open page holds a bounded `Subscription` of notices;
one that falls behind gets `RESYNC` and renders itself again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from nonomad.client import ApiError
from nonomad.console import model
from registry.replica import FOLLOW_RESYNC, Replica, Subscription, status_name
from registry.v1 import registry_pb2

__all__ = ["RESYNC", "Live", "Notice"]

log = structlog.get_logger("console.live")

FEED_SIZE = 500
NOTICE_QUEUE = 4096
RETRY_MIN, RETRY_MAX = 0.1, 10.0

Placements = Callable[[Callable[[], None]], AsyncIterator[platform_pb2.WatchPlacementsResponse]]
"""Opens a watch of flaps' decisions, calling its argument once flaps has registered it."""


@dataclass(frozen=True)
class Notice:
    """Something a page may show changed.

    kind "machine": `machine_id` of `app` on `worker_id` changed (`event` is the step, `row`
    the machine after it, without its event tail); "status": a worker's liveness, connection,
    info or cordon changed, or it joined; "capacity": a worker's heartbeat; "snapshot": a
    worker's rows were replaced; "feed": `item` joined the feed; "resync": the page fell
    behind: render everything again.
    """

    kind: Literal["machine", "status", "capacity", "snapshot", "feed", "resync"]
    worker_id: str = ""
    machine_id: str = ""
    app: str = ""
    event: pb.MachineEvent | None = None
    row: pb.Machine | None = None
    item: model.Data | None = field(default=None, compare=False)


RESYNC = Notice("resync")


class Live:
    """The feed and the notices (see the module docstring). Run `run(shutdown)` as a task."""

    def __init__(
        self, replica: Replica, placements: Placements | None, *, feed_size: int = FEED_SIZE
    ) -> None:
        self.replica = replica
        self.placements = placements
        self.feed: collections.deque[model.Data] = collections.deque(maxlen=feed_size)
        self._seq = itertools.count(1)
        self._subs: set[Subscription[Notice]] = set()
        # What the feed last said of each worker: its liveness and whether it was cordoned.
        self._workers: dict[str, tuple[str, bool]] = {}
        self.placements_watched = asyncio.Event()
        """Set while flaps' placement decisions are being watched."""

    # -- pages ---------------------------------------------------------------------------------

    def subscribe(self, maxsize: int = NOTICE_QUEUE) -> Subscription[Notice]:
        """Notices from now on, until closed (with the hub, on shutdown)."""
        sub: Subscription[Notice] = Subscription(maxsize, RESYNC, self._subs.discard)
        self._subs.add(sub)
        return sub

    def items(self, after: int = 0) -> list[model.Data]:
        """The feed items numbered above `after`, oldest first."""
        return [item for item in self.feed if item["seq"] > after]

    @property
    def last_seq(self) -> int:
        return self.feed[-1]["seq"] if self.feed else 0

    def close(self) -> None:
        """End every page's stream."""
        for sub in list(self._subs):
            sub.close()

    def _publish(self, notice: Notice) -> None:
        if notice.item is not None:
            notice.item["seq"] = next(self._seq)
            self.feed.append(notice.item)
        for sub in list(self._subs):
            sub.put(notice)

    # -- running -------------------------------------------------------------------------------

    async def run(self, shutdown: asyncio.Event) -> None:
        """Follow the replica and flaps' decisions until `shutdown`; then close every stream."""
        tasks = [asyncio.create_task(self._follow(), name="console/follow")]
        if self.placements is not None:
            tasks.append(asyncio.create_task(self._watch(shutdown), name="console/placements"))
        try:
            await shutdown.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()

    async def _follow(self) -> None:
        feed = self.replica.follow()
        self._know_workers()
        async with feed:
            async for resp in feed:
                if resp is FOLLOW_RESYNC:
                    feed.clear()
                    self._know_workers()
                    self._publish(RESYNC)
                    continue
                self._apply(resp)

    def _know_workers(self) -> None:
        for view in self.replica.workers():
            self._workers[view.info.id] = (status_name(view.status), view.capacity.cordoned)

    def _apply(self, resp: registry_pb2.FollowResponse) -> None:
        worker_id = resp.worker_id
        kind = resp.item.WhichOneof("item") if resp.HasField("item") else None
        if kind == "change":
            change = resp.item.change
            m = change.machine
            self._publish(
                Notice(
                    "machine",
                    worker_id,
                    m.id,
                    m.app,
                    event=change.event,
                    row=m,
                    item=model.feed_change(change),
                )
            )
        elif kind == "heartbeat":
            self._publish(Notice("capacity", worker_id))
        elif kind == "snapshot" and not resp.item.snapshot.more:
            self._publish(Notice("snapshot", worker_id))
        self._worker_changes(worker_id, resp.item.heartbeat.time if kind == "heartbeat" else None)

    def _worker_changes(self, worker_id: str, at: Timestamp | None) -> None:
        """Feed items for a worker whose liveness or cordon differs from what the feed said."""
        view = self.replica.worker(worker_id)
        if view is None:
            return
        status, cordoned = status_name(view.status), view.capacity.cordoned
        was = self._workers.get(worker_id)
        if was == (status, cordoned):
            return
        self._workers[worker_id] = (status, cordoned)
        if at is None:
            at = Timestamp()
            at.GetCurrentTime()
        if was is None:
            self._publish(Notice("status", worker_id, item=model.feed_worker(view, "joined", at)))
        elif was[0] != status:
            self._publish(Notice("status", worker_id, item=model.feed_worker(view, status, at)))
        if was is not None and was[1] != cordoned:
            what = "cordoned" if cordoned else "uncordoned"
            self._publish(Notice("status", worker_id, item=model.feed_worker(view, what, at)))

    async def _watch(self, shutdown: asyncio.Event) -> None:
        """Watch flaps' decisions for as long as the console runs, reconnecting with a backoff
        (a flaps restart, or a token that may not watch: said once, then retried quietly)."""
        assert self.placements is not None
        backoff = RETRY_MIN
        said = ""
        while not shutdown.is_set():
            try:
                async for resp in self.placements(self.placements_watched.set):
                    backoff, said = RETRY_MIN, ""
                    self._publish(
                        Notice(
                            "feed",
                            resp.event.worker_id,
                            resp.event.machine_id,
                            resp.event.app,
                            item=model.feed_placement(resp.event),
                        )
                    )
                reason = "the stream ended"
            except ApiError as err:
                reason = str(err)
            self.placements_watched.clear()
            if reason != said:
                log.warning("placements_unwatched", reason=reason, retry_in=backoff)
                said = reason
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.wait(), backoff)
            backoff = min(2 * backoff, RETRY_MAX)
