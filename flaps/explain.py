"""Why a machine is where it is: placement decisions as records, for keeping and for watching.

flaps is stateless, so it hands each decision on the moment it is made:

- to the worker, with the create (`flyd.v1.CreateMachineRequest.placement`): the worker keeps
  it with the machine's row for the machine's whole life, and `GetPlacement` reads it back
  (`nonomad machines why`, the console). `record()` builds it, trimmed to what the worker
  accepts (`model.validate.PLACEMENT_LIMITS`): per region the best candidates and the named
  rejections, claim refusals first; the counts by reason always cover every worker.
- to whoever watches this flaps (`PlatformService.WatchPlacements`): `Watchers` fans each
  region's outcome out to bounded queues, and costs nothing while nobody watches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from flaps.placement import Candidate, Decision
from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from model.validate import MAX_PLACEMENT_DETAIL, MAX_PLACEMENT_NAMED, MAX_PLACEMENT_REGIONS
from registry.replica import Subscription
from runtime.clock import SYSTEM_CLOCK, Clock

__all__ = ["DROPPED", "Watchers", "record", "region_record"]

# Events a watcher may fall behind by before the queued ones are dropped.
WATCH_QUEUE = 1024


def region_record(
    decision: Decision, outcome: str, winner: Candidate | None = None
) -> pb.RegionPlacement:
    """One region's decision as a worker keeps it: the first candidates in rank order (and the
    winner, wherever it ranked), the named rejections with the claims refused first, and the
    counts by reason of every worker."""
    out = pb.RegionPlacement(
        region=decision.region,
        examined=decision.examined + bool(decision.keyed),
        outcome=outcome,
        keyed_worker_id=decision.keyed,
    )
    ranked = decision.candidates[:MAX_PLACEMENT_NAMED]
    if winner is not None and winner not in ranked:
        ranked.append(winner)
    for c in ranked:
        out.candidates.add(worker_id=c.worker_id, score=c.score, sub_scores=c.sub_scores)
    # A refused claim is on a candidate; a stage's rejection never is.
    claimed = {c.worker_id for c in decision.candidates}
    named = sorted(decision.rejections, key=lambda r: r.worker_id not in claimed)
    for r in named[:MAX_PLACEMENT_NAMED]:
        out.rejections.add(
            worker_id=r.worker_id, reason=r.reason, detail=r.detail[:MAX_PLACEMENT_DETAIL]
        )
    for reason, n in decision.counts().items():
        out.rejections_by_reason[reason] = n
    return out


def record(
    tried: Sequence[pb.RegionPlacement],
    decision: Decision,
    winner: Candidate,
    sample_size: int,
    now: float,
) -> pb.PlacementDecision:
    """The whole decision for a claim on `winner`: the regions `tried` before (exhausted), then
    this one, placed on `winner` at `now` (epoch seconds)."""
    out = pb.PlacementDecision(sample_size=sample_size, worker_id=winner.worker_id)
    out.decided_at.FromNanoseconds(round(now * 1e9))
    out.regions.extend(tried[: MAX_PLACEMENT_REGIONS - 1])
    out.regions.append(region_record(decision, "placed", winner))
    return out


DROPPED = platform_pb2.PlacementEvent()
"""What a watcher's queue holds in place of the events it fell too far behind on."""


class Watchers:
    """The watchers of this flaps' placement decisions, each with a bounded queue."""

    def __init__(self, maxsize: int = WATCH_QUEUE, *, clock: Clock = SYSTEM_CLOCK) -> None:
        """`clock` stamps each event."""
        self.maxsize = maxsize
        self.clock = clock
        self._subs: set[Subscription[platform_pb2.PlacementEvent]] = set()

    def publish(
        self,
        app: str,
        decision: Decision,
        outcome: str,
        *,
        winner: Candidate | None = None,
        machine_id: str = "",
        fallback: bool = False,
    ) -> None:
        """Tell every watcher of one region's decision (nothing is built without watchers)."""
        if not self._subs:
            return
        event = platform_pb2.PlacementEvent(
            app=app,
            region=decision.region,
            outcome=outcome,
            machine_id=machine_id,
            worker_id=winner.worker_id if winner is not None else "",
            score=winner.score if winner is not None else 0.0,
            candidates=len(decision.candidates),
            rejections_by_reason=dict(decision.counts()),
            fallback=fallback,
        )
        event.time.FromNanoseconds(round(self.clock.now() * 1e9))
        for sub in list(self._subs):
            sub.put(event)

    async def watch(
        self, subscribed: Callable[[tuple[()]], Awaitable[None]] | None = None
    ) -> AsyncIterator[platform_pb2.WatchPlacementsResponse]:
        """Every decision from now on, until the caller stops iterating. `subscribed` is
        awaited once the watch is registered (the RPC sends its headers: a client then knows
        that every decision after that reaches it)."""
        sub: Subscription[platform_pb2.PlacementEvent] = Subscription(
            self.maxsize, DROPPED, self._subs.discard
        )
        self._subs.add(sub)
        dropped = False
        async with sub:
            if subscribed is not None:
                await subscribed(())
            async for event in sub:
                if event is DROPPED:
                    dropped = True
                    continue
                yield platform_pb2.WatchPlacementsResponse(event=event, dropped=dropped)
                dropped = False

    def close(self) -> None:
        """End every watch (on shutdown)."""
        for sub in list(self._subs):
            sub.close()
