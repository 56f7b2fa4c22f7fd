"""The runner: drives each machine's state machine, committing every step before its effects.

One `Worker` per flyd. It owns the in-memory copy of every machine row (the
LMDB log is the truth; the copy is rebuilt from it at start), serialises the
operations on each machine with a per-machine lock, performs the effects the
pure core (flyd.fsm) asks for, and publishes each committed change to
WatchEvents subscribers and waiters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from flyd import fsm
from flyd.drivers.base import Driver, ExitStatus, Handle, Limits, ProcessSpec
from flyd.errors import (
    DESTROYED,
    REPLACED,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from flyd.images.cache import Image, ImageCache
from flyd.metrics import CREATE_SECONDS, count_transition
from flyd.settings import CapacitySettings
from flyd.store import Compacted, MachineLog, NewRecord, RecordType
from flyd.traces import OpSpan, OpTracer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from flyd.validate import check_config
from runtime.clock import Clock
from runtime.validate import check_name

log = structlog.get_logger("flyd.worker")
S = pb.MachineState
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A subscriber further behind than this many changes catches up from the log instead.
SUBSCRIBER_QUEUE = 4096
# How many destroyed machines stay readable (GetMachine, waits) before their rows go.
KEEP_DESTROYED = 1000
# The longest idempotency key a create may carry.
MAX_KEY = 200
_LAGGED = object()
_SPAWN_ONLY = (fsm.Spawn(),)


@dataclass(slots=True)
class _Totals:
    """Resources reserved by a set of machines, kept as running sums."""

    cpu_millicores: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    machines: int = 0

    def add(self, guest: pb.GuestConfig, sign: int = 1) -> None:
        self.cpu_millicores += sign * guest.cpu_millicores
        self.memory_mib += sign * guest.memory_mib
        self.disk_mib += sign * guest.disk_mib
        self.machines += sign


@dataclass
class Identity:
    worker_id: str
    region: str
    address: str
    labels: dict[str, str]
    boot_id: str


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Worker:
    """All machines of this worker, and the only code that changes them."""

    def __init__(
        self,
        *,
        identity: Identity,
        store: MachineLog,
        driver: Driver,
        images: ImageCache,
        capacity: CapacitySettings,
        ports: range,
        machine_host: str,
        clock: Clock,
        policy: fsm.Policy,
        log_keep: int = 10_000,
        state_dir: Path | None = None,
        port_free: Callable[[str, int], bool] = _port_free,
        op_tracer: OpTracer | None = None,
    ) -> None:
        """`op_tracer`: spans of machine operations; None (tracing off) costs nothing."""
        self.identity = identity
        self.store = store
        self.driver = driver
        self.images = images
        self.total = capacity
        self.ports = ports
        self.machine_host = machine_host
        self.clock = clock
        self.policy = policy
        self.log_keep = log_keep
        self._state_dir = state_dir
        self._port_free = port_free
        self.rows: dict[str, fsm.Row] = {}
        # Running totals over `rows`, so placement checks and heartbeats cost O(1).
        self._used = _Totals()
        self._by_state: collections.Counter[int] = collections.Counter()
        # Machines being created: reserved (and their ports taken) before their first commit.
        self._pending: dict[str, pb.Machine] = {}
        # (app, idempotency key) -> the machine it created (or is creating): one key, one
        # machine. Durable as the rows are: rebuilt from them, forgotten with a dropped row.
        self._keys: dict[tuple[str, str], str] = {}
        # Machines whose durable row lags behind `rows` by a lazy step (see fsm.Transition).
        self._dirty: set[str] = set()
        self._op_tracer = op_tracer
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscribers: set[asyncio.Queue[object]] = set()
        self._tick: asyncio.Future[None] | None = None
        self.cordoned = bool(state_dir and (state_dir / "cordoned").exists())
        self.closing = False

    # --- start and stop ---------------------------------------------------

    def recover(self) -> int:
        """Load every row and resume unfinished operations. Returns how many were resumed."""
        for machine_id, raw in self.store.rows().items():
            row = fsm.decode_row(raw)
            self.rows[machine_id] = row
            self._account(None, row)
            if row.state != S.MACHINE_STATE_DESTROYED:
                self.images.use(row.image_digest)
        resumed = 0
        for machine_id, row in self.rows.items():
            alive = False
            if row.handle is not None:
                # A process that is gone is reported through on_exit with its real status.
                alive = self.driver.attach(machine_id, Handle.from_dict(row.handle))
            if row.op is not None and (alive or row.handle is None):
                self._spawn_task(self.drive(machine_id, fsm.Resume(alive=alive)))
                resumed += 1
        log.info("recovered", machines=len(self.rows), resumed=resumed, seq=self.store.last_seq())
        return resumed

    async def close(self) -> None:
        """Stop background work; machines keep running."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for q in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)

    def on_exit(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        """The driver's exit callback: turn it into an Exited event."""
        if self.closing or machine_id not in self.rows:
            return
        tail: tuple[str, ...] = ()
        with contextlib.suppress(Exception):
            tail = tuple(self.driver.read_logs(machine_id, 20))
        event = fsm.Exited(
            handle.to_dict(),
            status.exit_code,
            status.signal,
            status.oom_killed,
            tail,
            released=status.released,
        )
        self._spawn_task(self.drive(machine_id, event))

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background step failed", exc_info=task.exception())

    # --- the drive loop ---------------------------------------------------

    def _lock(self, machine_id: str) -> asyncio.Lock:
        lock = self._locks.get(machine_id)
        if lock is None:
            lock = self._locks[machine_id] = asyncio.Lock()
        return lock

    async def drive(
        self,
        machine_id: str,
        event: fsm.Event,
        *,
        lease_nonce: str | None = None,
        op_span: tuple[str, OpSpan] | None = None,
    ) -> None:
        """Apply an event; a caller's request (lease_nonce given) must hold any lease."""
        async with self._lock(machine_id):
            if lease_nonce is not None:
                fsm.check_lease(self.rows[machine_id], lease_nonce, self.clock.now())
            await self._drive_locked(machine_id, event, op_span=op_span)

    async def _drive_locked(
        self,
        machine_id: str,
        event: fsm.Event | None,
        staged: list[fsm.Transition] | None = None,
        *,
        op_span: tuple[str, OpSpan] | None = None,
    ) -> None:
        """Step the machine until it rests, committing each step before its effects run.

        A step whose one effect is Spawn is the exception: the driver's spawn holds the new
        process before it runs anything, so the step is committed together with the spawn's
        outcome (one transaction instead of two). A crash before that commit leaves a held
        process that dies with flyd, and the last committed step is resumed as before.
        `staged` are steps computed but not committed yet (a create's first ones). `op_span`
        (op, span) receives the steps from the first commit on, in place of any open one.
        """
        staged = staged if staged is not None else []
        row = staged[-1].row if staged else self.rows[machine_id]
        try:
            while event is not None:
                transition = fsm.step(row, event, now=self.clock.now(), policy=self.policy)
                if transition is None:
                    break
                if transition.lazy:
                    assert not staged, "a lazy step follows an effect, so a commit"
                    self._apply_lazy(machine_id, transition)
                    row = transition.row
                    event = await self._perform(machine_id, transition)
                    continue
                staged.append(transition)
                row = transition.row
                if transition.effects == _SPAWN_ONLY:
                    event = await self._spawn(machine_id, row)
                    continue
                if op_span is not None:
                    self._take_span(machine_id, op_span)
                    op_span = None
                self._commit(machine_id, staged)
                staged = []
                event = await self._perform(machine_id, transition)
            if staged:
                if op_span is not None:
                    self._take_span(machine_id, op_span)
                self._commit(machine_id, staged)
                staged = []
        finally:
            if staged and staged[-1].row.handle is not None:
                # Spawned but never committed: the held process must not run.
                self.driver.discard(machine_id)

    def _apply_lazy(self, machine_id: str, t: fsm.Transition) -> None:
        """A change of flyd's internals that may become durable later (see fsm.Transition).

        It rides along with the next commit of any machine, or `flush`.
        """
        self.rows[machine_id] = t.row
        self._dirty.add(machine_id)
        if self._op_tracer is not None and t.row.op is None:
            self._op_tracer.rested(machine_id)

    def flush(self) -> None:
        """Commit the rows whose durable copy lags behind (lazy steps); flyd calls it often."""
        if self._dirty:
            dirty = {mid: fsm.encode_row(self.rows[mid]) for mid in self._dirty}
            self.store.commit([], dirty)
            self._dirty.clear()

    def _take_span(self, machine_id: str, op_span: tuple[str, OpSpan]) -> None:
        if self._op_tracer is not None:
            self._op_tracer.attach(machine_id, op_span[1], op_span[0])

    async def _spawn(self, machine_id: str, row: fsm.Row) -> fsm.Event:
        try:
            handle = await self.driver.start(self._spec(row))
        except Exception as err:  # any failure to spawn is the machine's, not ours
            log.warning("spawn failed", machine_id=machine_id, error=str(err))
            return fsm.SpawnFailed(str(err))
        return fsm.Spawned(handle.to_dict())

    async def _perform(self, machine_id: str, t: fsm.Transition) -> fsm.Event | None:
        row = t.row
        next_event: fsm.Event | None = None
        for effect in t.effects:
            match effect:
                case fsm.Spawn():
                    next_event = await self._spawn(machine_id, row)
                case fsm.Release():
                    self.driver.release(machine_id)
                    next_event = fsm.Released()
                case fsm.Kill(signal=sig, timeout=timeout):
                    assert row.handle is not None
                    self._spawn_task(self._kill(machine_id, row.handle, sig, timeout))
                case fsm.SendSignal(signal=sig):
                    with contextlib.suppress(NotFound):
                        await self.driver.signal(machine_id, sig)
                    next_event = fsm.Signalled()
                case fsm.Cleanup():
                    await self.driver.cleanup(machine_id)
                    next_event = fsm.CleanedUp()
                case fsm.StartTimer(at=when):
                    self._spawn_task(self._timer(machine_id, when))
        return next_event

    async def _kill(
        self, machine_id: str, handle: dict[str, object], sig: int, timeout: float
    ) -> None:
        try:
            status = await self.driver.stop(machine_id, sig, timeout)
        except NotFound:
            status = ExitStatus(exit_code=None, signal=9, oom_killed=False)
        # The driver's on_exit reports the same exit; whichever comes second is ignored.
        await self.drive(
            machine_id,
            fsm.Exited(
                dict(handle),
                status.exit_code,
                status.signal,
                status.oom_killed,
                released=status.released,
            ),
        )

    async def _timer(self, machine_id: str, when: float) -> None:
        await self.clock.sleep_until(when)
        await self.drive(machine_id, fsm.TimerFired())

    def _commit(self, machine_id: str, steps: list[fsm.Transition]) -> None:
        """One transaction: a log record per step and the row after the last. Then tell all.

        Steps computed together (a step and its spawn's outcome) are committed together; each
        record still carries the machine as it was after its own step.
        """
        seq = self.store.last_seq()
        changes: list[worker_pb2.MachineChange] = []
        tail: Sequence[pb.MachineEvent] | None = None  # the event tail after the step before
        for t in steps:
            seq += 1
            machine = t.row.machine
            if tail is not None:
                del machine.events[:]
                machine.events.extend(tail)
            event = pb.MachineEvent(
                seq=seq,
                machine_id=machine_id,
                type=t.type,
                from_state=t.from_state,  # type: ignore[arg-type]
                to_state=t.to_state,  # type: ignore[arg-type]
                reason=t.reason,
                time=machine.updated_at,
            )
            if t.from_state != t.to_state:
                machine.events.append(event)
                if len(machine.events) > fsm.EVENT_TAIL:
                    del machine.events[: len(machine.events) - fsm.EVENT_TAIL]
            tail = machine.events
            changes.append(worker_pb2.MachineChange(event=event, machine=machine))
        row = steps[-1].row
        rows = {mid: fsm.encode_row(self.rows[mid]) for mid in self._dirty}  # lazy steps
        rows[machine_id] = fsm.encode_row(row)
        self.store.commit(
            [NewRecord(RecordType.MACHINE_CHANGE, c.SerializeToString()) for c in changes], rows
        )
        self._dirty.clear()
        self._account(self.rows.get(machine_id), row)
        self.rows[machine_id] = row
        self._pending.pop(machine_id, None)  # a create's reservation is now the row's
        op_span = None
        for t, change in zip(steps, changes, strict=True):
            op_span = self._committed(machine_id, t, change.event.seq) or op_span
        if op_span is None:
            self._log_commit(machine_id, steps, seq)
        else:
            with op_span.current():  # the line carries the operation's trace, even in a task
                self._log_commit(machine_id, steps, seq)
        for change in changes:
            self._publish(change)
        if self.store.last_seq() - self.store.first_seq() >= 2 * self.log_keep:
            self._compact()

    @staticmethod
    def _log_commit(machine_id: str, steps: list[fsm.Transition], seq: int) -> None:
        # One line per commit: steps committed together (create, start, running) share it.
        first, last = steps[0], steps[-1]
        log.info(
            first.type,
            machine_id=machine_id,
            state=fsm.state_name(last.to_state),
            from_state=fsm.state_name(first.from_state),
            reason=last.reason if len(steps) == 1 else "; ".join(t.reason for t in steps),
            seq=seq,
        )

    def _committed(self, machine_id: str, t: fsm.Transition, seq: int) -> OpSpan | None:
        """What follows one committed step: images, metrics, the operation's span.

        Returns the operation's span, if one is open.
        """
        if t.from_state != t.to_state:
            count_transition(t.from_state, t.to_state)
            if t.to_state == S.MACHINE_STATE_DESTROYED:
                self.images.release(t.row.image_digest)
        if self._op_tracer is not None:
            return self._op_tracer.committed(machine_id, t, seq)
        return None

    def _account(self, old: fsm.Row | None, new: fsm.Row | None) -> None:
        """Keep the running totals (reservations, machines by state) and the keys held in
        step with the rows."""
        for row, sign in ((old, -1), (new, 1)):
            if row is None:
                continue
            self._by_state[row.state] += sign
            if row.state != S.MACHINE_STATE_DESTROYED:
                self._used.add(row.machine.config.guest, sign)
            if row.machine.idempotency_key:
                key = (row.machine.app, row.machine.idempotency_key)
                if sign > 0:
                    self._keys[key] = row.machine.id
                elif self._keys.get(key) == row.machine.id:
                    del self._keys[key]

    def _publish(self, change: worker_pb2.MachineChange) -> None:
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

    def _compact(self) -> None:
        destroyed = [
            (row.machine.updated_at.ToNanoseconds(), mid)
            for mid, row in self.rows.items()
            if row.state == S.MACHINE_STATE_DESTROYED
        ]
        drop = {mid for _, mid in sorted(destroyed)[: max(0, len(destroyed) - KEEP_DESTROYED)]}
        if drop:
            self.store.commit([], dict.fromkeys(drop))
            for mid in drop:
                self._account(self.rows.pop(mid), None)
                self._locks.pop(mid, None)
        dropped = self.store.compact(self.log_keep)
        log.info(
            "log compacted",
            dropped=dropped,
            first_seq=self.store.first_seq(),
            destroyed_rows_dropped=len(drop),
        )

    # --- capacity -----------------------------------------------------------

    def reserved(self) -> pb.Resources:
        """What the machines that are not destroyed reserve, plus creates under way."""
        used = self._used
        res = pb.Resources(
            cpu_millicores=used.cpu_millicores,
            memory_mib=used.memory_mib,
            disk_mib=used.disk_mib,
            machines=used.machines,
        )
        for machine in self._pending.values():
            guest = machine.config.guest
            res.cpu_millicores += guest.cpu_millicores
            res.memory_mib += guest.memory_mib
            res.disk_mib += guest.disk_mib
            res.machines += 1
        return res

    def machines_by_state(self) -> dict[int, int]:
        """How many machines (rows, destroyed ones included while kept) are in each state."""
        return {state: n for state, n in self._by_state.items() if n}

    def capacity(self) -> pb.Capacity:
        total = pb.Resources(
            cpu_millicores=self.total.cpu_millicores,
            memory_mib=self.total.memory_mib,
            disk_mib=self.total.disk_mib,
            machines=self.total.machines,
        )
        used = self.reserved()
        free = pb.Resources(
            cpu_millicores=total.cpu_millicores - used.cpu_millicores,
            memory_mib=total.memory_mib - used.memory_mib,
            disk_mib=total.disk_mib - used.disk_mib,
            machines=total.machines - used.machines,
        )
        cap = pb.Capacity(total=total, free=free, cordoned=self.cordoned)
        for state, count in self.machines_by_state().items():
            cap.machines_by_state[fsm.state_name(state)] = count
        for img in self.images.cached():
            cached = cap.images.add(ref=img.ref, digest=img.digest, size_bytes=img.size_bytes)
            cached.last_used.FromNanoseconds(int(img.last_used * 1e9))
        return cap

    def _check_room(self, guest: pb.GuestConfig, instead_of: pb.GuestConfig | None = None) -> None:
        """Raise ResourceExhausted unless `guest` fits (replacing `instead_of`, for an update)."""
        used = self.reserved()
        if instead_of is not None:
            used.cpu_millicores -= instead_of.cpu_millicores
            used.memory_mib -= instead_of.memory_mib
            used.disk_mib -= instead_of.disk_mib
            used.machines -= 1
        wants = [
            (
                "cpu",
                guest.cpu_millicores,
                self.total.cpu_millicores - used.cpu_millicores,
                "millicores",
            ),
            ("memory", guest.memory_mib, self.total.memory_mib - used.memory_mib, "MiB"),
            ("disk", guest.disk_mib, self.total.disk_mib - used.disk_mib, "MiB"),
            ("machines", 1, self.total.machines - used.machines, "machines"),
        ]
        for resource, need, free, unit in wants:
            if need > free:
                raise ResourceExhausted(
                    resource,
                    f"worker {self.identity.worker_id} has {free} {unit} of {resource} free; "
                    f"the machine needs {need}",
                )

    def _allocate_ports(self, count: int) -> list[int]:
        if count == 0:
            return []
        used = {
            p.host_port
            for row in self.rows.values()
            if row.state != S.MACHINE_STATE_DESTROYED
            for p in row.machine.ports
        }
        used.update(p.host_port for m in self._pending.values() for p in m.ports)
        found: list[int] = []
        for port in self.ports:
            if port in used or not self._port_free(self.machine_host, port):
                continue
            found.append(port)
            if len(found) == count:
                return found
        raise ResourceExhausted(
            "ports",
            f"worker {self.identity.worker_id} has no free host port in "
            f"{self.ports.start}-{self.ports.stop - 1}",
        )

    # --- operations ---------------------------------------------------------

    def get(self, machine_id: str) -> fsm.Row:
        if not machine_id:
            raise InvalidArgument("machine_id", "is required")
        row = self.rows.get(machine_id)
        if row is None:
            raise NotFound(f"machine {machine_id} not found on worker {self.identity.worker_id}")
        return row

    def list_machines(
        self, *, app: str = "", state: int = 0, include_destroyed: bool = False
    ) -> list[pb.Machine]:
        return [
            row.machine
            for row in self.rows.values()
            if (not app or row.machine.app == app)
            and (not state or row.state == state)
            and (
                include_destroyed
                or state == S.MACHINE_STATE_DESTROYED
                or row.state != S.MACHINE_STATE_DESTROYED
            )
        ]

    async def create(
        self,
        *,
        machine_id: str,
        name: str,
        app: str,
        config: pb.MachineConfig,
        skip_launch: bool,
        idempotency_key: str = "",
    ) -> pb.Machine:
        """Create a machine and, unless skip_launch, start it; returns it at rest (STARTED).

        A create of `app` under an `idempotency_key` this worker holds returns the key's
        machine (whatever `machine_id` says, room or not); one under way is waited for."""
        t0 = time.perf_counter()
        check_name("machine_id", machine_id, required=False)
        if len(idempotency_key) > MAX_KEY:
            raise InvalidArgument("idempotency_key", f"must be at most {MAX_KEY} characters")
        mid = machine_id or secrets.token_hex(7)
        if idempotency_key:
            mid = self._keys.get((app, idempotency_key), mid)
        machine = await self._traced(
            "create",
            mid,
            app,
            lambda op_span: self._create(
                mid, name, app, config, skip_launch, idempotency_key, op_span
            ),
        )
        CREATE_SECONDS.observe(time.perf_counter() - t0)
        return machine

    async def _traced(
        self,
        op: str,
        machine_id: str,
        app: str,
        run: Callable[[tuple[str, OpSpan] | None], Awaitable[pb.Machine]],
    ) -> pb.Machine:
        """`run(op_span)`, as the span `flyd.<op>` when tracing is on (else op_span is None).

        The span ends here if the operation failed or the machine is at rest; otherwise with
        the commit that brings it to rest (see flyd.traces).
        """
        if self._op_tracer is None:
            return await run(None)
        span = self._op_tracer.start(op, machine_id, app)
        try:
            machine = await run((op, span))
        except BaseException as err:
            self._op_tracer.finish(machine_id, span, err, resting=True)
            raise
        row = self.rows.get(machine_id)
        self._op_tracer.finish(machine_id, span, None, resting=row is None or row.op is None)
        return machine

    async def _create(
        self,
        machine_id: str,
        name: str,
        app: str,
        config: pb.MachineConfig,
        skip_launch: bool,
        key: str,
        op_span: tuple[str, OpSpan] | None,
    ) -> pb.Machine:
        check_name("app", app)
        if len(name) > 63:
            raise InvalidArgument("name", "must be at most 63 characters")
        check_config(config)
        if (existing := self._existing(machine_id, app, config)) is not None:
            return existing
        if machine_id in self._pending:
            # The same create is under way (a retry, or another flaps with the same key): its
            # outcome is ours, whatever room is left once it has reserved its own.
            async with self._lock(machine_id):
                if (existing := self._existing(machine_id, app, config)) is not None:
                    return existing
        if self.cordoned or self.closing:
            raise Unavailable(
                f"worker {self.identity.worker_id} is "
                f"{'cordoned' if self.cordoned else 'shutting down'}"
            )
        self._check_room(config.guest)  # fail fast, before pulling anything
        image = await self.images.pull(config.image)
        self.images.use(image.digest)  # at once, so the pulled image cannot be evicted
        try:
            if not self._argv(config, image):
                raise InvalidArgument("config.cmd", "the image has no entrypoint or cmd; set one")
            # Another machine took the key while the image was pulled: its outcome is ours.
            held = self._keys.get((app, key), machine_id) if key else machine_id
            if held != machine_id:
                async with self._lock(held):
                    existing = self._existing(held, app, config)
                if existing is not None:
                    self.images.release(image.digest)
                    return existing
            async with self._lock(machine_id):
                if (existing := self._existing(machine_id, app, config)) is not None:
                    self.images.release(image.digest)
                    return existing
                # The check and the reservation are atomic: the machine is reserved (as
                # pending) before the first await, and its first commit makes that its row's.
                self._check_room(config.guest)
                ports = self._allocate_ports(len(config.services))
                machine = pb.Machine(
                    id=machine_id,
                    name=name or machine_id,
                    app=app,
                    region=self.identity.region,
                    worker_id=self.identity.worker_id,
                    config=config,
                    instance_id=secrets.token_hex(8),
                    idempotency_key=key,
                )
                for svc, port in zip(config.services, ports, strict=True):
                    machine.ports.add(
                        internal_port=svc.internal_port, host=self.machine_host, host_port=port
                    )
                first = fsm.create(
                    machine,
                    image_digest=image.digest,
                    skip_launch=skip_launch,
                    now=self.clock.now(),
                )
                self._pending[machine_id] = machine
                if key:
                    self._keys[(app, key)] = machine_id
                try:
                    # The pending start goes on in the same operation: its spawn comes before
                    # the first commit, which records the creation, the start and the process.
                    await self._drive_locked(
                        machine_id, fsm.Resume(alive=False), [first], op_span=op_span
                    )
                finally:
                    self._pending.pop(machine_id, None)
        except BaseException:
            if machine_id not in self.rows:
                self.images.release(image.digest)
                if self._keys.get((app, key)) == machine_id:
                    del self._keys[(app, key)]
            raise
        return self.rows[machine_id].machine

    def _existing(self, machine_id: str, app: str, config: pb.MachineConfig) -> pb.Machine | None:
        row = self.rows.get(machine_id)
        if row is None:
            return None
        if row.machine.app != app or row.machine.config != config:
            raise AlreadyExists(f"machine {machine_id} exists with another app or config")
        return row.machine

    async def _operate(
        self, op: str, machine_id: str, event: fsm.Event, lease_nonce: str
    ) -> pb.Machine:
        """Run one requested operation on a machine; traced as `flyd.<op>` when tracing is on."""

        async def run(op_span: tuple[str, OpSpan] | None) -> pb.Machine:
            await self.drive(machine_id, event, lease_nonce=lease_nonce, op_span=op_span)
            return self.rows[machine_id].machine

        return await self._traced(op, machine_id, self.get(machine_id).machine.app, run)

    async def start(self, machine_id: str, *, lease_nonce: str = "") -> pb.Machine:
        return await self._operate("start", machine_id, fsm.StartRequested(), lease_nonce)

    async def stop(
        self, machine_id: str, sig: int | None, timeout: float | None, *, lease_nonce: str = ""
    ) -> pb.Machine:
        sig, timeout = self._stop_params(self.get(machine_id), sig, timeout)
        event = fsm.StopRequested(sig, timeout)
        return await self._operate("stop", machine_id, event, lease_nonce)

    async def restart(
        self, machine_id: str, sig: int | None, timeout: float | None, *, lease_nonce: str = ""
    ) -> pb.Machine:
        sig, timeout = self._stop_params(self.get(machine_id), sig, timeout)
        event = fsm.RestartRequested(sig, timeout)
        return await self._operate("restart", machine_id, event, lease_nonce)

    async def signal(self, machine_id: str, sig: int, *, lease_nonce: str = "") -> pb.Machine:
        return await self._operate("signal", machine_id, fsm.SignalRequested(sig), lease_nonce)

    async def destroy(self, machine_id: str, force: bool, *, lease_nonce: str = "") -> pb.Machine:
        return await self._operate("destroy", machine_id, fsm.DestroyRequested(force), lease_nonce)

    async def update(
        self,
        machine_id: str,
        config: pb.MachineConfig,
        *,
        skip_launch: bool,
        lease_nonce: str = "",
    ) -> pb.Machine:
        """Replace the machine's config in place: same id, new instance_id."""
        check_config(config)
        return await self._traced(
            "update",
            machine_id,
            self.get(machine_id).machine.app,
            lambda op_span: self._update(machine_id, config, skip_launch, lease_nonce, op_span),
        )

    async def _update(
        self,
        machine_id: str,
        config: pb.MachineConfig,
        skip_launch: bool,
        lease_nonce: str,
        op_span: tuple[str, OpSpan] | None,
    ) -> pb.Machine:
        row = self.get(machine_id)
        fsm.check_lease(row, lease_nonce, self.clock.now())
        if row.state == S.MACHINE_STATE_DESTROYED:
            raise FailedPrecondition(f"cannot update a destroyed machine {machine_id}", DESTROYED)
        self._check_room(config.guest, instead_of=row.machine.config.guest)  # fail fast
        image = await self.images.pull(config.image)
        self.images.use(image.digest)
        instance_id = secrets.token_hex(8)
        old_digest = row.image_digest
        try:
            if not self._argv(config, image):
                raise InvalidArgument("config.cmd", "the image has no entrypoint or cmd; set one")
            async with self._lock(machine_id):
                row = self.rows[machine_id]
                fsm.check_lease(row, lease_nonce, self.clock.now())
                # No await from here to the commit: the check and the reservation are atomic.
                self._check_room(config.guest, instead_of=row.machine.config.guest)
                old_digest = row.image_digest
                sig, timeout = self._stop_params(row, None, None)
                event = fsm.UpdateRequested(
                    config=config,
                    instance_id=instance_id,
                    image_digest=image.digest,
                    ports=tuple(self._remap_ports(row, config)),
                    launch=not skip_launch,
                    stop_signal=sig,
                    stop_timeout=timeout,
                )
                await self._drive_locked(machine_id, event, op_span=op_span)
        except BaseException:
            # Cancelled after the commit, the row already holds the new image: drop the old.
            now = self.rows.get(machine_id)
            committed = now is not None and now.machine.instance_id == instance_id
            self.images.release(old_digest if committed else image.digest)
            raise
        self.images.release(old_digest)
        return self.rows[machine_id].machine

    def _remap_ports(self, row: fsm.Row, config: pb.MachineConfig) -> list[pb.PortMapping]:
        """Keep the host port of every service port that stays; map the new ones."""
        kept = {p.internal_port: p for p in row.machine.ports}
        new = [svc.internal_port for svc in config.services if svc.internal_port not in kept]
        fresh = iter(self._allocate_ports(len(new)))
        out = []
        for svc in config.services:
            mapping = kept.get(svc.internal_port)
            if mapping is None:
                mapping = pb.PortMapping(
                    internal_port=svc.internal_port, host=self.machine_host, host_port=next(fresh)
                )
            out.append(mapping)
        return out

    async def acquire_lease(
        self, machine_id: str, *, ttl: float, owner: str, description: str, nonce: str
    ) -> pb.Lease:
        """Take (or refresh) the machine's lease; the response is the only place its nonce shows."""
        self.get(machine_id)
        async with self._lock(machine_id):
            t = fsm.acquire_lease(
                self.rows[machine_id],
                new_nonce=secrets.token_hex(16),
                nonce=nonce,
                ttl=ttl,
                owner=owner,
                description=description,
                now=self.clock.now(),
            )
            self._commit(machine_id, [t])
        lease = self.rows[machine_id].lease
        assert lease is not None
        out = pb.Lease()
        out.CopyFrom(self.rows[machine_id].machine.lease)
        out.nonce = lease["nonce"]
        return out

    async def release_lease(self, machine_id: str, nonce: str) -> None:
        self.get(machine_id)
        async with self._lock(machine_id):
            t = fsm.release_lease(self.rows[machine_id], nonce, self.clock.now())
            if t is not None:
                self._commit(machine_id, [t])

    @staticmethod
    def _stop_params(row: fsm.Row, sig: int | None, timeout: float | None) -> tuple[int, float]:
        from runtime.validate import duration_seconds, parse_signal

        stop = row.machine.config.stop
        if sig is None:
            sig = parse_signal("config.stop.signal", stop.signal)
        if timeout is None:
            timeout = duration_seconds(
                "config.stop.timeout",
                stop.timeout,
                default=10.0,
                maximum=300.0,
                present=stop.HasField("timeout"),
            )
        return sig, timeout

    async def wait(
        self, machine_id: str, state: int, timeout: float, instance_id: str = ""
    ) -> pb.Machine:
        if state == S.MACHINE_STATE_UNSPECIFIED or state not in pb.MachineState.values():
            raise InvalidArgument("state", "must name a machine state")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            row = self.get(machine_id)
            if row.state == state and (not instance_id or row.machine.instance_id == instance_id):
                return row.machine
            if instance_id and row.machine.instance_id != instance_id:
                raise FailedPrecondition(
                    f"machine {machine_id} is now instance "
                    f"{row.machine.instance_id}, not {instance_id}",
                    REPLACED,
                )
            if row.state == S.MACHINE_STATE_DESTROYED:
                raise FailedPrecondition(
                    f"machine {machine_id} is destroyed; it will never be {fsm.state_name(state)}",
                    DESTROYED,
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"machine {machine_id} is {fsm.state_name(row.state)}, not "
                    f"{fsm.state_name(state)}, after {timeout:g}s"
                )
            if self._tick is None:
                self._tick = loop.create_future()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
            # arrives as the awaited change does, and the caller then waits on to its deadline.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await asyncio.shield(self._tick)

    def cordon(self, cordoned: bool) -> bool:
        self.cordoned = cordoned
        if self._state_dir is not None:
            marker = self._state_dir / "cordoned"
            if cordoned:
                marker.touch()
            else:
                marker.unlink(missing_ok=True)
        log.info("cordon", cordoned=cordoned)
        return cordoned

    # --- the event stream ---------------------------------------------------

    def snapshot(self, reason: str) -> worker_pb2.Snapshot:
        snap = self.store.snapshot()
        return worker_pb2.Snapshot(
            seq=snap.seq,
            reason=reason,
            machines=[fsm.decode_row(raw).machine for raw in snap.rows.values()],
        )

    def heartbeat(self) -> worker_pb2.Heartbeat:
        hb = worker_pb2.Heartbeat(
            seq=self.store.last_seq(), worker=self.info(), capacity=self.capacity()
        )
        hb.time.FromNanoseconds(int(self.clock.now() * 1e9))
        return hb

    def info(self) -> pb.WorkerInfo:
        ident = self.identity
        return pb.WorkerInfo(
            id=ident.worker_id,
            region=ident.region,
            address=ident.address,
            labels=ident.labels,
            boot_id=ident.boot_id,
        )

    async def watch(
        self, from_seq: int, *, heartbeat_interval: float, stop: asyncio.Event
    ) -> AsyncIterator[worker_pb2.WatchEventsResponse]:
        """Every change after from_seq (or a snapshot first), then live, with heartbeats."""
        if from_seq > self.store.last_seq():
            raise InvalidArgument(
                "from_seq", f"{from_seq} is ahead of this worker's log ({self.store.last_seq()})"
            )
        queue: asyncio.Queue[object] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        try:
            pos = from_seq
            if from_seq == 0:
                snap = self.snapshot("requested")
                pos = snap.seq
                yield worker_pb2.WatchEventsResponse(snapshot=snap)
            loop = asyncio.get_running_loop()
            next_beat = loop.time()
            caught_up = False
            while not stop.is_set() and not self.closing:
                if not caught_up:
                    try:
                        async for item in self._replay(pos):
                            yield item
                            pos = item.change.event.seq
                    except Compacted:
                        snap = self.snapshot("compacted")
                        pos = snap.seq
                        yield worker_pb2.WatchEventsResponse(snapshot=snap)
                        continue
                    caught_up = True
                if loop.time() >= next_beat:
                    yield worker_pb2.WatchEventsResponse(heartbeat=self.heartbeat())
                    next_beat = loop.time() + heartbeat_interval
                try:
                    async with asyncio.timeout(max(0.0, next_beat - loop.time())):  # see wait()
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

    def events(self, machine_id: str) -> Iterable[pb.MachineEvent]:
        """The machine's state changes still in the log, oldest first."""
        self.get(machine_id)
        after = self.store.first_seq() - 1
        while batch := self.store.read(after, 1000):
            for rec in batch:
                change = worker_pb2.MachineChange.FromString(rec.body)
                if change.event.machine_id == machine_id:
                    yield change.event
                after = rec.seq

    # --- process specs ------------------------------------------------------

    @staticmethod
    def _argv(config: pb.MachineConfig, image: Image) -> list[str]:
        entrypoint = list(config.entrypoint) or list(image.entrypoint)
        if config.cmd:
            cmd = list(config.cmd)
        else:
            # As with OCI runtimes: overriding the entrypoint drops the image's CMD.
            cmd = [] if config.entrypoint else list(image.cmd)
        return entrypoint + cmd

    def _spec(self, row: fsm.Row) -> ProcessSpec:
        machine = row.machine
        config = machine.config
        image = self.images.get(row.image_digest)
        if image is None:
            raise NotFound(f"image {row.image_digest} is no longer cached")
        argv = self._argv(config, image)
        rootfs = image.rootfs
        if argv and argv[0].startswith("/") and (rootfs / argv[0].lstrip("/")).exists():
            argv[0] = str(rootfs / argv[0].lstrip("/"))
        env = {"PATH": DEFAULT_PATH, **image.env, **config.env}
        env.update(
            MACHINE_ID=machine.id,
            APP=machine.app,
            REGION=machine.region,
            WORKER_ID=machine.worker_id,
            INSTANCE_ID=machine.instance_id,
        )
        for i, port in enumerate(machine.ports):
            if i == 0:
                env["PORT"] = str(port.host_port)
            env[f"PORT_{port.internal_port}"] = str(port.host_port)
        guest = config.guest
        return ProcessSpec(
            machine_id=machine.id,
            argv=argv,
            cwd=rootfs / image.workdir.lstrip("/"),
            env=env,
            limits=Limits(cpu_millicores=guest.cpu_millicores, memory_mib=guest.memory_mib),
        )
