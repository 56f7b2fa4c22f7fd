"""The replica's state without I/O: who the workers are, their machine rows, their liveness.

A `View` changes only through `add`, `apply`, `apply_upstream` and `tick`, each given the time
by its caller and each returning the `ReplicaEvent`s it caused, so tests can drive it step by
step and the runtime (`registry.replica`) only has to move bytes and publish events.

Every row has one writer, the worker that owns it, so applying is simple: a worker's stream is
applied in its own sequence order (a change at or below the applied seq is a repeat and is
ignored; a change that skips one is a `SequenceGap`), a snapshot replaces the worker's rows
once its last part has arrived (a large one comes in parts: model.pages), and nothing from one
worker ever touches another worker's rows. A worker whose log starts over (its data dir was
wiped: a heartbeat names another log epoch, or a new boot with a lower sequence) is reset and
followed from a new snapshot (`LogRestarted`): its rows are replaced, never merged. A worker
dead for longer than `forget_after` is dropped with its rows (`forget`).

Nothing here costs a pass over the fleet per change: rows are kept by id and by app, the
`registry.supply.Supply` that placement reads is updated in O(log n) as heartbeats and rows
arrive, and liveness is judged only for the workers whose silence just crossed a threshold
(they are kept in the order they were last heard from).

What a row costs: the replica keeps each machine as the bytes its worker sent, without the
event tail and the log tail (`events`, `log_tail`: reads of those go to the worker), plus its
app and state. A reader gets a fresh `pb.Machine` parsed from those bytes.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import structlog

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model import pages
from model.pages import snapshot_parts
from registry.errors import (
    BrokenSnapshot,
    InvalidArgument,
    LogRestarted,
    SequenceGap,
    WrongWorker,
)
from registry.rows import Kept, MachineQuery, Row, RowIndex, key_hash
from registry.supply import Resources, Supply
from registry.v1 import registry_pb2
from runtime import parse_host_port
from runtime.validate import is_boot_id, is_name, quote

log = structlog.get_logger("registry.view")

Status: TypeAlias = registry_pb2.MemberStatus.ValueType
UNKNOWN: Status = registry_pb2.MEMBER_STATUS_UNSPECIFIED
ALIVE: Status = registry_pb2.MEMBER_STATUS_ALIVE
SUSPECT: Status = registry_pb2.MEMBER_STATUS_SUSPECT
DEAD: Status = registry_pb2.MEMBER_STATUS_DEAD

DESTROYED = pb.MACHINE_STATE_DESTROYED


# Seconds after it was sent (on the worker's clock) past which a heartbeat counts as held up on
# the way (View.key_doubts): more than the transit and the clocks' skew.
LATE = 0.5

# Workers `View.tick` judges at once: each one that turns suspect or dead leaves the supply's
# index and is logged (30 to 100 microseconds), so a batch holds the loop under a millisecond.
TICK_BATCH = 8

_STATUS_NAMES: dict[int, str] = {ALIVE: "alive", SUSPECT: "suspect", DEAD: "dead"}


def status_name(status: int) -> str:
    """`alive`, `suspect`, `dead` or `unknown` (never heard from)."""
    return _STATUS_NAMES.get(status, "unknown")


@dataclass(frozen=True)
class WorkerView:
    """One worker as the replica sees it. A new object on every read; protos are shared."""

    info: pb.WorkerInfo
    """Who the worker is; `address` is where the replica reaches it."""
    status: Status
    """registry.v1 MemberStatus: UNSPECIFIED until the first heartbeat, then ALIVE, SUSPECT,
    DEAD by heartbeat age."""
    last_heartbeat: float
    """Clock time of the last heartbeat received; 0.0 when none was."""
    capacity: pb.Capacity
    """As of the last heartbeat."""
    seq: int
    """The last worker log sequence number applied."""
    connected: bool
    """Whether the replica's stream from the worker (or its upstream) is open right now."""
    snapshots: int = 0
    """How many snapshots were applied: 1 for a worker followed without a gap since it was
    learned of; more after compaction, a reset or upstream resyncs."""


@dataclass(frozen=True)
class Doubt:
    """A worker that may hold (or be making) an idempotency key's machine the view has no
    row of (`View.key_doubts`)."""

    worker_id: str
    address: str
    creating: bool
    """Its last heartbeat says it is making the machine right now."""
    silent_for: float
    """Seconds since the view last heard from it (clock time); 0.0 when `creating`."""


@dataclass(frozen=True)
class ReplicaEvent:
    """Something changed in the view.

    kind "machine": `machine` is the row after the change, or None when the row is gone (a
    snapshot no longer has it: the worker dropped a destroyed row); `machine_id` names it either
    way. kind "worker": the worker's status, info or connection changed; re-read `worker()`.
    kind "resync": the subscriber fell behind and events were dropped; re-read the view.
    `status` is the worker's status when the event was made.
    """

    kind: Literal["machine", "worker", "resync"]
    worker_id: str
    machine: pb.Machine | None
    status: Status
    machine_id: str = ""


RESYNC = ReplicaEvent(kind="resync", worker_id="", machine=None, status=UNKNOWN)


@dataclass(frozen=True)
class Applied:
    """What applying one item did: the events, and whether followers should see the item."""

    events: list[ReplicaEvent]
    relay: bool


_IGNORED = Applied([], relay=False)


def check_worker_info(info: pb.WorkerInfo, field_prefix: str = "worker") -> None:
    """Raise InvalidArgument naming the first bad field of a WorkerInfo."""
    if not info.id:
        raise InvalidArgument(f"{field_prefix}.id", "is required")
    if not is_name(info.id):
        raise InvalidArgument(
            f"{field_prefix}.id",
            f"{quote(info.id)} must be 1-63 lowercase letters, digits or dashes",
        )
    if not info.region:
        raise InvalidArgument(f"{field_prefix}.region", "is required")
    if not is_name(info.region):
        raise InvalidArgument(
            f"{field_prefix}.region",
            f"{quote(info.region)} must be 1-63 lowercase letters, digits or dashes",
        )
    if not info.address:
        raise InvalidArgument(f"{field_prefix}.address", "is required")
    try:
        _, port = parse_host_port(info.address)
    except ValueError as err:
        raise InvalidArgument(f"{field_prefix}.address", str(err)) from None
    if port == 0:
        raise InvalidArgument(f"{field_prefix}.address", "port 0 is not an address to dial")
    if not is_boot_id(info.boot_id):
        raise InvalidArgument(f"{field_prefix}.boot_id", "at most 64 letters, digits, . _ -")


@dataclass
class _Member:
    info: pb.WorkerInfo
    added: float
    status: Status = UNKNOWN
    last_heartbeat: float = 0.0
    # When the worker was last heard from (a heartbeat, or an upstream vouching for it); the
    # time it was added before that. Liveness is the age of this.
    heard: float = 0.0
    capacity: pb.Capacity = field(default_factory=pb.Capacity)
    seq: int = 0
    connected: bool = False
    rows: dict[str, Kept] = field(default_factory=dict)
    snapshots: int = 0
    # Upstream mode: the status the upstream replica reports.
    upstream_status: Status = UNKNOWN
    # The next snapshot applies even when its seq is below ours (the worker's log restarted).
    force_snapshot: bool = False
    # The parts of a snapshot received so far, until its last part arrives.
    partial: worker_pb2.Snapshot | None = None
    # The log our seq counts in, as its snapshots and heartbeats name it ("": not said yet).
    log_epoch: str = ""
    # As of its last heartbeat, on the worker's clock (0.0: none yet): every row it held then
    # came before it; and the machines it was making then under an idempotency key.
    vouched: float = 0.0
    creating: tuple[str, ...] = ()

    def view(self) -> WorkerView:
        return WorkerView(
            info=self.info,
            status=self.status,
            last_heartbeat=self.last_heartbeat,
            capacity=self.capacity,
            seq=self.seq,
            connected=self.connected,
            snapshots=self.snapshots,
        )


@dataclass(frozen=True)
class Added:
    """What `View.add` did: `new` worker, whether its stream must be (re)opened, the events."""

    new: bool
    refollow: bool
    events: list[ReplicaEvent]


class View:
    """Workers, their rows and liveness. Pure: no I/O, no clock of its own, no tasks.

    `upstream=True` is the view of a replica that follows another replica: liveness is the
    worse of what the upstream reports and what the age of the relayed heartbeats says (so a
    lost upstream shows its workers as suspect, then dead, instead of frozen as alive).
    """

    def __init__(
        self,
        *,
        suspect_after: float,
        dead_after: float,
        upstream: bool = False,
        forget_after: float = 600.0,
    ) -> None:
        if not suspect_after > 0:
            raise ValueError(f"suspect_after must be > 0 seconds, got {suspect_after!r}")
        if not dead_after > suspect_after:
            raise ValueError(
                f"dead_after ({dead_after!r}s) must be greater than "
                f"suspect_after ({suspect_after!r}s)"
            )
        if not forget_after > dead_after:
            raise ValueError(
                f"forget_after ({forget_after!r}s) must be greater than "
                f"dead_after ({dead_after!r}s)"
            )
        self.suspect_after = suspect_after
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.upstream = upstream
        self._members: dict[str, _Member] = {}
        # Who holds each machine id, the ids by app in order, machines by key: a read by id
        # is O(1), a page of machines in id order O(log n + page).
        self._index = RowIndex()
        # Workers by when they were last heard from, oldest first: those whose silence says
        # alive (or not heard yet) and those it says suspect. `tick` looks only at the heads.
        self._fresh: OrderedDict[str, _Member] = OrderedDict()
        self._suspect: OrderedDict[str, _Member] = OrderedDict()
        # And those it says dead, for `forget`.
        self._dead: OrderedDict[str, _Member] = OrderedDict()
        # Worker ids, sorted, of the fleet (key None) and of each region: pages of workers.
        self._ids: dict[str | None, list[str]] = {None: []}
        # For `key_doubts`, kept as heartbeats come: the machines each worker is making under
        # a key, by the id's tail after "<worker>-" (flaps names them so); and the workers
        # whose last heartbeat came later than LATE after it was sent (held up on the way).
        self._creating: dict[str, set[str]] = {}
        self._late: dict[str, _Member] = {}
        self.supply = Supply()
        """Free resources, liveness and machines per app of every worker, for placement."""

    # -- membership ----------------------------------------------------------------------------

    def add(self, info: pb.WorkerInfo, now: float) -> Added:
        """Learn of a worker (validated), or update one whose address or boot id changed.

        A new address or boot id asks for the worker's stream to be reopened (`refollow`): the
        worker moved or restarted, and following the new one at once beats waiting out a
        reconnect backoff. Region and labels are updated in place.
        """
        check_worker_info(info)
        m = self._members.get(info.id)
        if m is None:
            m = self._new_member(info, now)
            log.info("worker_added", worker=info.id, region=info.region, address=info.address)
            return Added(new=True, refollow=True, events=[self._worker_event(m)])
        moved = info.address != m.info.address
        rebooted = bool(info.boot_id) and info.boot_id != m.info.boot_id
        if moved or rebooted:
            self._set_info(m, _copy(info))
            log.info(
                "worker_updated",
                worker=info.id,
                address=info.address,
                boot_id=info.boot_id,
                moved=moved,
            )
            return Added(new=False, refollow=True, events=[self._worker_event(m)])
        if info.region != m.info.region or dict(info.labels) != dict(m.info.labels):
            self._set_info(m, _copy(info, boot_id=m.info.boot_id))
            return Added(new=False, refollow=False, events=[self._worker_event(m)])
        return Added(new=False, refollow=False, events=[])

    def reset(self, worker_id: str) -> None:
        """The worker's log is behind what we applied (it was wiped): take its next snapshot
        whatever its seq, and ask for one by following from 0."""
        self._reset(self._members[worker_id], "its log is behind the applied seq")

    def _reset(self, m: _Member, why: str) -> None:
        log.warning("worker_log_reset", worker=m.info.id, applied_seq=m.seq, why=why)
        m.seq = 0
        m.force_snapshot = True
        m.log_epoch = ""

    def resume_epoch(self, worker_id: str) -> str:
        """The log `resume_seq` counts in ("" when unknown)."""
        return self._members[worker_id].log_epoch

    def forget(self, now: float) -> tuple[list[ReplicaEvent], list[str]]:
        """Drop the workers dead for longer than `forget_after`, with their rows: (the events,
        the ids dropped). One that comes back is learned of again (it announces itself). Only
        the longest dead are looked at (`_dead` is in the order they were last heard from)."""
        events: list[ReplicaEvent] = []
        gone: list[str] = []
        while self._dead:
            m = next(iter(self._dead.values()))
            if now - m.heard < self.forget_after:
                break
            del self._dead[m.info.id]
            if m.status != DEAD:
                continue  # (an upstream vouches for it: not ours to forget)
            for machine_id in list(m.rows):
                self._drop_row(m, machine_id)
                events.append(self._machine_event(m, machine_id, None))
            del self._members[m.info.id]
            self._fresh.pop(m.info.id, None)
            self._suspect.pop(m.info.id, None)
            self._late.pop(m.info.id, None)
            self._set_creating(m, ())
            for key in (None, m.info.region):
                ids = self._ids.get(key)
                if ids is not None and m.info.id in ids:
                    ids.remove(m.info.id)
                    if key is not None and not ids:
                        del self._ids[key]
            self.supply.remove(m.info.id)
            events.append(self._worker_event(m))
            gone.append(m.info.id)
            log.warning(
                "worker_forgotten",
                worker=m.info.id,
                region=m.info.region,
                dead_for=round(now - m.heard, 3),
            )
        return events, gone

    def set_connected(self, worker_id: str, connected: bool) -> list[ReplicaEvent]:
        m = self._members.get(worker_id)
        if m is None or m.connected == connected:
            return []
        m.connected = connected
        return [self._worker_event(m)]

    def disconnect_all(self) -> list[ReplicaEvent]:
        """The upstream stream broke: nothing is connected any more."""
        return [e for worker_id in self._members for e in self.set_connected(worker_id, False)]

    def resume_seq(self, worker_id: str) -> int:
        """Where to follow the worker's stream from: the last seq applied (0: snapshot first)."""
        return self._members[worker_id].seq

    # -- applying ------------------------------------------------------------------------------

    def apply(self, worker_id: str, item: worker_pb2.WatchEventsResponse, now: float) -> Applied:
        """Apply one item of the worker's own WatchEvents stream (direct mode)."""
        m = self._members.get(worker_id)
        if m is None:
            return _IGNORED
        return self._apply_item(m, item, now)

    def apply_upstream(self, resp: registry_pb2.FollowResponse, now: float) -> Applied:
        """Apply one item of an upstream replica's Follow stream (upstream mode)."""
        m = self._members.get(resp.worker_id)
        events: list[ReplicaEvent] = []
        if m is None:
            if not resp.HasField("worker"):
                return _IGNORED
            try:
                check_worker_info(resp.worker)
            except InvalidArgument as err:
                log.warning("upstream_worker_invalid", worker=resp.worker_id, error=str(err))
                return _IGNORED
            m = self._new_member(resp.worker, now)
            events.append(self._worker_event(m))
        elif resp.HasField("worker") and resp.worker != m.info:
            if resp.worker.boot_id and resp.worker.boot_id != m.info.boot_id:
                # A restarted (maybe wiped) worker: the upstream's next snapshot of it is the truth.
                m.force_snapshot = True
            self._set_info(m, _copy(resp.worker))
            events.append(self._worker_event(m))
        m.upstream_status = resp.status
        if resp.status == ALIVE and now > m.heard:
            self._heard(m, now)  # the upstream vouches for it right now
        if not m.connected:
            m.connected = True
            events.append(self._worker_event(m))
        applied = self._apply_item(m, resp.item, now) if resp.HasField("item") else _IGNORED
        events += applied.events
        events += self._update_status(m, now)
        return Applied(_dedupe_worker_events(events), relay=applied.relay)

    def _apply_item(self, m: _Member, item: worker_pb2.WatchEventsResponse, now: float) -> Applied:
        kind = item.WhichOneof("item")
        if kind == "snapshot":
            return self._apply_snapshot(m, item.snapshot)
        if kind == "change":
            return self._apply_change(m, item.change)
        if kind == "heartbeat":
            return self._apply_heartbeat(m, item.heartbeat, now)
        log.warning("unknown_stream_item", worker=m.info.id, kind=kind)
        return _IGNORED

    def _apply_snapshot(self, m: _Member, part: worker_pb2.Snapshot) -> Applied:
        if part.part == 0:
            m.partial = None
        elif m.partial is None or part.seq != m.partial.seq or part.part != m.partial.part + 1:
            m.partial = None
            raise BrokenSnapshot(m.info.id, f"part {part.part} of seq {part.seq} out of order")
        # Older than what we have: a lagging source (unless it is another log, which replaces
        # ours whatever its seq). Decided by seq and epoch, the same for every part.
        other_log = bool(part.log_epoch and m.log_epoch and part.log_epoch != m.log_epoch)
        stale = part.seq < m.seq and not m.force_snapshot and not other_log
        if not stale:
            for machine in part.machines:
                _check_owner(m, machine)
        if part.more or m.partial is not None:
            if m.partial is None:
                m.partial = worker_pb2.Snapshot()
            m.partial.MergeFrom(part)  # machines appended; seq, part, more the latest's
            if part.more:
                return Applied([], relay=not stale)
            snap, m.partial = m.partial, None
        else:
            snap = part
        if stale:
            return _IGNORED
        m.force_snapshot = False
        if snap.log_epoch:
            m.log_epoch = snap.log_epoch
        rows = {machine.id: machine for machine in snap.machines}
        events: list[ReplicaEvent] = []
        for machine_id in [mid for mid in m.rows if mid not in rows]:
            self._drop_row(m, machine_id)
            events.append(self._machine_event(m, machine_id, None))
        for machine_id, machine in rows.items():
            if self._put_row(m, machine):
                events.append(self._machine_event(m, machine_id, machine))
        m.seq = snap.seq
        m.snapshots += 1
        return Applied(events, relay=True)

    def _apply_change(self, m: _Member, change: worker_pb2.MachineChange) -> Applied:
        if m.partial is not None:
            m.partial = None
            raise BrokenSnapshot(m.info.id, "a change came before the last part")
        seq = change.event.seq
        if seq <= m.seq:
            return _IGNORED  # already applied (a replay overlapping what we have)
        if seq != m.seq + 1:
            raise SequenceGap(m.info.id, m.seq, seq)
        machine = change.machine
        _check_owner(m, machine)
        m.seq = seq
        self._put_row(m, machine)
        return Applied([self._machine_event(m, machine.id, machine)], relay=True)

    def _apply_heartbeat(self, m: _Member, hb: worker_pb2.Heartbeat, now: float) -> Applied:
        if hb.worker.id and hb.worker.id != m.info.id:
            raise WrongWorker(m.info.id, hb.worker.id)
        restarted = ""
        if hb.log_epoch and m.log_epoch and hb.log_epoch != m.log_epoch:
            restarted = f"log epoch {hb.log_epoch}, not {m.log_epoch}"
        elif hb.worker.boot_id and hb.worker.boot_id != m.info.boot_id and hb.seq < m.seq:
            restarted = f"new boot {hb.worker.boot_id} at seq {hb.seq} < {m.seq}"
        if restarted:
            self._reset(m, restarted)
            if not self.upstream:
                raise LogRestarted(m.info.id, restarted)  # follow it again, from a snapshot
            return _IGNORED  # the upstream sends its new snapshot
        events: list[ReplicaEvent] = []
        # Most heartbeats say what the last one said: then the supply has nothing to learn.
        same = m.capacity == hb.capacity
        if not same:
            # A copy: the heartbeat may be one item of a large message (a Follow batch), all
            # of which a reference into it would keep.
            m.capacity = pb.Capacity()
            m.capacity.CopyFrom(hb.capacity)
        m.last_heartbeat = now
        m.vouched = hb.time.seconds + hb.time.nanos / 1e9
        if hb.creating or m.creating:
            self._set_creating(m, tuple(hb.creating))
        if now - m.vouched > LATE:
            self._late[m.info.id] = m
        elif self._late:
            self._late.pop(m.info.id, None)
        self._heard(m, now)
        if hb.HasField("worker") and hb.worker != m.info:  # (mostly it is as we know it)
            # The worker is the truth about itself, except for the address we reach it at.
            theirs = hb.worker
            if (
                theirs.region != m.info.region
                or theirs.boot_id != m.info.boot_id
                or dict(theirs.labels) != dict(m.info.labels)
            ):
                updated = _copy(theirs, address=m.info.address)
                try:
                    check_worker_info(updated)
                except InvalidArgument as err:
                    log.warning("heartbeat_worker_invalid", worker=m.info.id, error=str(err))
                else:
                    self._set_info(m, updated)
                    events.append(self._worker_event(m))
        events += self._update_status(m, now)  # (each change the supply learns at once)
        if not same:
            self._supply(m)
        return Applied(_dedupe_worker_events(events), relay=True)

    # -- liveness ------------------------------------------------------------------------------

    def tick(self, now: float, batch: int = TICK_BATCH) -> list[ReplicaEvent]:
        """Re-judge liveness at `now`; events for the workers whose status changed.

        Only the workers whose silence crossed `suspect_after` or `dead_after` since the last
        tick are looked at: the oldest-heard heads of `_fresh` and `_suspect`; at most `batch`
        of them, so that a fleet going quiet at once (the upstream lost) is judged a batch at a
        time with the loop free between: call again while `due(now)`.
        """
        events: list[ReplicaEvent] = []
        for queue, limit in ((self._fresh, self.suspect_after), (self._suspect, self.dead_after)):
            while queue and batch > 0:
                m = next(iter(queue.values()))
                age = now - m.heard
                if age < limit:
                    break
                batch -= 1
                del queue[m.info.id]
                if age < self.dead_after:
                    self._suspect[m.info.id] = m
                else:
                    self._dead[m.info.id] = m
                events += self._update_status(m, now)
        return events

    def due(self, now: float) -> bool:
        """Whether `tick(now)` has workers left to judge (a batch did not take them all)."""
        return any(
            queue and now - next(iter(queue.values())).heard >= limit
            for queue, limit in (
                (self._fresh, self.suspect_after),
                (self._suspect, self.dead_after),
            )
        )

    def _heard(self, m: _Member, now: float) -> None:
        """The worker was heard from at `now` (the latest time yet): it goes to the back."""
        m.heard = now
        worker_id = m.info.id
        if worker_id in self._fresh:
            # Relinked, not deleted and added: churned by every heartbeat, the dict of 10,000
            # workers would be rebuilt (a millisecond or two) every second or so.
            self._fresh.move_to_end(worker_id)
            return
        self._suspect.pop(worker_id, None)
        self._dead.pop(worker_id, None)
        self._fresh[worker_id] = m

    def _age_status(self, m: _Member, now: float) -> Status:
        age = now - m.heard
        if age >= self.dead_after:
            return DEAD
        if age >= self.suspect_after:
            return SUSPECT
        return ALIVE if m.last_heartbeat or (self.upstream and m.upstream_status) else UNKNOWN

    def _update_status(self, m: _Member, now: float) -> list[ReplicaEvent]:
        status = self._age_status(m, now)
        if self.upstream:
            # The worse of the two: the upstream knows the worker, our clock knows the upstream.
            status = max(status, m.upstream_status)
        if status == m.status:
            return []
        log.info(
            "worker_status",
            worker=m.info.id,
            status=status_name(status),
            was=status_name(m.status),
            silent_for=round(now - m.heard, 3),
        )
        m.status = status
        self._supply(m)
        return [self._worker_event(m)]

    # -- the supply ----------------------------------------------------------------------------

    def _new_member(self, info: pb.WorkerInfo, now: float) -> _Member:
        m = _Member(info=_copy(info), added=now, heard=now)
        self._members[info.id] = m
        self._fresh[info.id] = m
        bisect.insort(self._ids[None], info.id)
        bisect.insort(self._ids.setdefault(info.region, []), info.id)
        self._supply(m)
        return m

    def _set_info(self, m: _Member, info: pb.WorkerInfo) -> None:
        if info.region != m.info.region:
            self._ids[m.info.region].remove(m.info.id)
            if not self._ids[m.info.region]:
                del self._ids[m.info.region]
            bisect.insort(self._ids.setdefault(info.region, []), info.id)
        m.info = info
        self._supply(m)

    def _supply(self, m: _Member) -> None:
        """Tell the supply what it knows of the worker now (it ignores what did not change)."""
        cap = m.capacity
        self.supply.update(
            m.info.id,
            region=m.info.region,
            labels=dict(m.info.labels),
            status=m.status,
            cordoned=cap.cordoned,
            total=Resources.of(cap.total),
            free=Resources.of(cap.free),
            images=frozenset(x for img in cap.images for x in (img.ref, img.digest) if x),
        )

    # -- reads ---------------------------------------------------------------------------------

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def worker(self, worker_id: str) -> WorkerView | None:
        m = self._members.get(worker_id)
        return None if m is None else m.view()

    def workers(self, region: str | None = None) -> list[WorkerView]:
        return [
            m.view() for m in self._members.values() if region is None or m.info.region == region
        ]

    def worker_page(
        self, region: str | None, after: str, limit: int
    ) -> tuple[list[WorkerView], str]:
        """Up to `limit` workers (of `region`) by id, after the id `after`; and the id to go
        on after, or "" when none are left. Costs the page, not the fleet."""
        ids = self._ids.get(region, [])
        start = bisect.bisect_right(ids, after) if after else 0
        page = ids[start : start + limit]
        more = start + limit < len(ids)
        return [self._members[i].view() for i in page], page[-1] if more and page else ""

    def regions(self) -> set[str]:
        return set(self.supply.regions())

    def key_doubts(
        self,
        regions: Sequence[str],
        suffix: str,
        *,
        vouched_since: float,
        now: float,
        give_up_after: float,
    ) -> tuple[list[Doubt], list[Doubt]]:
        """The workers of `regions` that may hold an idempotency key's machine (named
        "<worker>-<suffix>") without the view having its row: those whose last heartbeat says
        they are making it, and those whose last heartbeat was sent (their clock) before
        `vouched_since`, or who never sent one. Those silent for longer than `give_up_after`
        come second: no longer waited for.

        Costs the doubtful, not the fleet: a worker whose heartbeat was sent that early either
        arrived before `vouched_since + LATE` (the head of the liveness queues, oldest first)
        or arrived later than LATE after it was sent (`_late`).
        """
        wanted = set(regions)
        found: dict[str, Doubt] = {}
        for worker_id in self._creating.get(suffix, ()):
            m = self._members.get(worker_id)
            if m is not None and m.info.region in wanted:
                found[worker_id] = Doubt(worker_id, m.info.address, True, 0.0)
        arrived_by = vouched_since + LATE
        candidates = itertools.chain(
            itertools.takewhile(lambda m: m.heard < arrived_by, self._fresh.values()),
            self._suspect.values(),
            reversed(self._dead.values()),  # (the most lately heard first)
            self._late.values(),
        )
        expired: dict[str, Doubt] = {}
        for m in candidates:
            worker_id = m.info.id
            if m.vouched >= vouched_since or m.info.region not in wanted or worker_id in found:
                continue
            silent = now - m.heard
            if silent > give_up_after:
                expired[worker_id] = Doubt(worker_id, m.info.address, False, silent)
            else:
                found[worker_id] = Doubt(worker_id, m.info.address, False, silent)
        return list(found.values()), list(expired.values())

    def _set_creating(self, m: _Member, creating: tuple[str, ...]) -> None:
        prefix = f"{m.info.id}-"
        for machine_id in m.creating:
            if machine_id.startswith(prefix):
                makers = self._creating.get(machine_id[len(prefix) :])
                if makers is not None:
                    makers.discard(m.info.id)
                    if not makers:
                        del self._creating[machine_id[len(prefix) :]]
        m.creating = creating
        for machine_id in creating:
            if machine_id.startswith(prefix):
                self._creating.setdefault(machine_id[len(prefix) :], set()).add(m.info.id)

    def oldest_news(self, limit: int) -> list[tuple[str, float]]:
        """(worker id, clock time it was last heard from) of the `limit` workers not judged
        dead that were heard from longest ago, oldest first: the heads of the liveness queues,
        so the cost is `limit`, not the fleet."""
        out: list[tuple[str, float]] = []
        for queue in (self._suspect, self._fresh):
            for m in itertools.islice(queue.values(), max(0, limit - len(out))):
                out.append((m.info.id, m.heard))
        return out

    def liveness(self) -> list[tuple[str, Status, int]]:
        """(region, status, how many workers) from the supply's counts; safe to call from
        another thread (for metrics)."""
        return [
            (region, status, n)  # type: ignore[misc]
            for region, pool in list(self.supply.regions().items())
            for status, n in list(pool.by_status.items())
            if n
        ]

    def owner(self, machine_id: str) -> str | None:
        """The worker that holds the machine's row."""
        return self._index.owner(machine_id)

    def row(self, machine_id: str) -> Row | None:
        owner = self._index.owner(machine_id)
        kept = None if owner is None else self._members[owner].rows.get(machine_id)
        return None if kept is None else Row(*kept)

    def machine(self, machine_id: str) -> pb.Machine | None:
        row = self.row(machine_id)
        return None if row is None else row.machine()

    def by_key(self, app: str, key: str) -> pb.Machine | None:
        """The machine an idempotency key of the app created, in any worker's rows."""
        machine_id = self._index.by_key(key_hash(app, key))
        machine = None if machine_id is None else self.machine(machine_id)
        if machine is None or machine.app != app or machine.idempotency_key != key:
            return None
        return machine

    def machines(
        self, *, app: str | None = None, region: str | None = None, worker_id: str | None = None
    ) -> list[pb.Machine]:
        """The rows (parsed) of `app`, on the workers of `region`, of one worker: each filter
        optional. With `app` the cost is the app's machines, not the fleet's."""
        if app is not None:
            out = []
            for machine_id in self._index.ids(app) or ():
                owner = self._index.owner(machine_id)
                if owner is None or (worker_id is not None and owner != worker_id):
                    continue
                holder = self._members[owner]
                row = holder.rows.get(machine_id)
                if row is not None and (region is None or holder.info.region == region):
                    out.append(pb.Machine.FromString(row[3]))
            return out
        if worker_id is not None:
            m = self._members.get(worker_id)
            members: Iterable[_Member] = () if m is None else (m,)
        else:
            members = self._members.values()
        if region is not None:
            members = [m for m in members if m.info.region == region]
        return [pb.Machine.FromString(row[3]) for m in members for row in m.rows.values()]

    def apps(self) -> dict[str, int]:
        """Every app with rows here, with how many (destroyed rows still kept included)."""
        return {app: len(self._index.ids(app) or ()) for app in self._index.apps()}

    def machine_page(self, query: MachineQuery) -> tuple[list[pb.Machine], str]:
        """The page `query` asks for, at most `PAGE_BYTES` of it, and the token of the next
        page ("" after the last): `model.pages.page`'s contract, read off the index. Only the
        page's rows are parsed, and it is found without a pass over the app's machines."""
        ids = self._index.ids(query.app)
        out: list[pb.Machine] = []
        used = 0
        for machine_id in ids.after(query.after) if ids is not None else ():
            owner = self._index.owner(machine_id)
            assert owner is not None
            m = self._members[owner]
            if query.region is not None and m.info.region != query.region:
                continue
            row = m.rows[machine_id]
            if not query.keep(machine_id, row[0], row[1]):
                continue
            cost = len(row[3]) + 8
            if out and (len(out) == query.size or used + cost > pages.PAGE_BYTES):
                return out, out[-1].id
            out.append(pb.Machine.FromString(row[3]))
            used += cost
        return out, ""

    def follow_items(self) -> Iterator[registry_pb2.FollowResponse]:
        """The whole view as Follow stream items: per worker a snapshot (in parts), then its last
        heartbeat (so a downstream learns capacity at once), each with status and info.

        Lazily, worker by worker, so a caller can yield between them; the workers are those
        known when it was called."""
        for worker_id in list(self._members):
            m = self._members.get(worker_id)
            if m is None:
                continue  # forgotten meanwhile
            rows = (pb.Machine.FromString(row[3]) for row in m.rows.values())
            for part in snapshot_parts(m.seq, "requested", rows):
                part.log_epoch = m.log_epoch
                yield registry_pb2.FollowResponse(
                    worker_id=m.info.id,
                    status=m.status,
                    worker=m.info,
                    item=worker_pb2.WatchEventsResponse(snapshot=part),
                )
            if m.last_heartbeat:
                hb = worker_pb2.Heartbeat(
                    seq=m.seq,
                    worker=m.info,
                    capacity=m.capacity,
                    log_epoch=m.log_epoch,
                    creating=m.creating,
                )
                # The worker's own time (what its heartbeat vouches for), not our arrival's.
                hb.time.FromNanoseconds(int((m.vouched or m.last_heartbeat) * 1e9))
                yield registry_pb2.FollowResponse(
                    worker_id=m.info.id,
                    status=m.status,
                    worker=m.info,
                    item=worker_pb2.WatchEventsResponse(heartbeat=hb),
                )

    def relay(
        self, worker_id: str, item: worker_pb2.WatchEventsResponse | None
    ) -> registry_pb2.FollowResponse:
        """A Follow stream item for `item` of the worker (None: a status-only update)."""
        m = self._members[worker_id]
        resp = registry_pb2.FollowResponse(worker_id=worker_id, status=m.status, worker=m.info)
        if item is not None:
            resp.item.CopyFrom(item)
        return resp

    # -- rows ----------------------------------------------------------------------------------

    def _put_row(self, m: _Member, machine: pb.Machine) -> bool:
        """Keep `machine` (stripped of its event and log tails); False if nothing changed."""
        machine_id = machine.id
        if machine.events or machine.log_tail:
            machine.ClearField("events")
            machine.ClearField("log_tail")
        data = machine.SerializeToString(deterministic=True)
        kept = m.rows.get(machine_id)
        if kept is not None and kept[3] == data:
            return False
        old = None if kept is None else Row(*kept)
        app = sys.intern(machine.app)
        key = key_hash(app, machine.idempotency_key) if machine.idempotency_key else 0
        row = Row(app, machine.state, key, data)
        m.rows[machine_id] = tuple(row)  # type: ignore[assignment]
        self._count(m, old, -1)
        self._count(m, row, 1)
        owner = self._index.owner(machine_id)
        if owner == m.info.id:
            assert old is not None
            self._index.refile(machine_id, old, row)
            return True
        if owner is not None:
            log.warning("machine_id_conflict", machine_id=machine_id, owner=owner, other=m.info.id)
            self._index.unfile(machine_id, Row(*self._members[owner].rows[machine_id]))
        self._index.set_owner(machine_id, m.info.id)
        self._index.file(machine_id, row)
        return True

    def _drop_row(self, m: _Member, machine_id: str) -> None:
        old = Row(*m.rows.pop(machine_id))
        self._count(m, old, -1)
        if self._index.owner(machine_id) == m.info.id:
            self._index.unfile(machine_id, old)
            self._index.set_owner(machine_id, None)

    def _count(self, m: _Member, row: Row | None, sign: int) -> None:
        """The supply counts each worker's machines (not destroyed) per app."""
        if row is not None and row.state != DESTROYED:
            self.supply.count(m.info.id, row.app, sign)

    def _machine_event(
        self, m: _Member, machine_id: str, machine: pb.Machine | None
    ) -> ReplicaEvent:
        return ReplicaEvent("machine", m.info.id, machine, m.status, machine_id)

    def _worker_event(self, m: _Member) -> ReplicaEvent:
        return ReplicaEvent("worker", m.info.id, None, m.status)


def _check_owner(m: _Member, machine: pb.Machine) -> None:
    """Every row has one writer: a row of another worker means we follow the wrong one."""
    if machine.worker_id and machine.worker_id != m.info.id:
        raise WrongWorker(m.info.id, machine.worker_id)


def _dedupe_worker_events(events: list[ReplicaEvent]) -> list[ReplicaEvent]:
    """One "worker" event per worker is enough (the last, with the final status)."""
    if len(events) < 2:
        return events
    last_worker = {e.worker_id: i for i, e in enumerate(events) if e.kind == "worker"}
    return [e for i, e in enumerate(events) if e.kind != "worker" or last_worker[e.worker_id] == i]


def _copy(info: pb.WorkerInfo, **override: str) -> pb.WorkerInfo:
    out = pb.WorkerInfo()
    out.CopyFrom(info)
    for name, value in override.items():
        setattr(out, name, value)
    return out


__all__ = [
    "ALIVE",
    "DEAD",
    "RESYNC",
    "SUSPECT",
    "TICK_BATCH",
    "UNKNOWN",
    "Added",
    "Applied",
    "ReplicaEvent",
    "Row",
    "Status",
    "View",
    "WorkerView",
    "check_worker_info",
    "key_hash",
    "status_name",
]
