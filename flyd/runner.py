"""The runner: drives each machine's state machine, committing every step before its effects.

It owns the in-memory copy of every machine row (the LMDB log is the truth; `recover`
rebuilds the copy from it at start and resumes unfinished operations), serialises the steps
of each machine with a per-machine lock, performs the effects the pure core (flyd.fsm) asks
for (spawn, kill, signal, cleanup, timers) and turns the driver's exit reports into events.
Commits go through flyd.commits (a writer thread, concurrent operations' commits in one
transaction); once a commit is durable, and not before, what follows it happens here: the row
in memory, reservations, image references, metrics, the operation's span, the log line,
publishing to flyd.stream, compaction. A step's effects run only after that. The operations
callers ask for (create, stop, update, leases, ...) are flyd.worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence

import structlog

from flyd import fsm
from flyd.commits import GroupCommit, Writer, durable
from flyd.drivers.base import Driver, ExitStatus, Handle, LogTail
from flyd.images.cache import ImageCache
from flyd.metrics import CLEANUP_FAILURES, count_transition
from flyd.reservations import Reservations
from flyd.secrets import SecretBox
from flyd.spec import process_spec, published
from flyd.store import MachineLog, NewRecord, RecordType
from flyd.stream import EventStream
from flyd.traces import OpSpan, OpTracer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model.errors import DeadlineExceeded, FailedPrecondition, NotFound
from runtime.clock import Clock

# The worker's one log: its lines carry the same logger name, whichever module writes them.
log = structlog.get_logger("flyd.worker")
S = pb.MachineState
# How many destroyed machines stay readable (GetMachine, waits) before their rows go.
KEEP_DESTROYED = 1000
# Characters of each of the last log lines a failed machine's row keeps.
LOG_TAIL_CHARS = 1024
# The last lines of its log an exit reads for the row, and the most bytes it reads for them.
EXIT_TAIL_LINES = 20
EXIT_TAIL_BYTES = 64 << 10
LOG_READS = 4
"""Log reads in flight at once (each in a thread, each holding up to its byte cap): what
machine logs can cost flyd's memory, however many readers and exits there are."""
_SPAWN_ONLY = (fsm.Spawn(),)


class Runner:
    """Every machine's rows and the one loop that steps them: the only code that changes them."""

    def __init__(
        self,
        *,
        rows: dict[str, fsm.Row],
        store: MachineLog,
        driver: Driver,
        images: ImageCache,
        reservations: Reservations,
        stream: EventStream,
        clock: Clock,
        policy: fsm.Policy,
        log_keep: int,
        op_tracer: OpTracer | None,
        secret_box: SecretBox,
        commit_writer: Writer | None = None,
    ) -> None:
        """`rows`: the worker's rows, empty until `recover` loads them from the store;
        `secret_box` opens their secrets for the processes' environment; `commit_writer`:
        who writes the store's transactions (flyd.commits; a simulated disk's)."""
        self.store = store
        self.driver = driver
        self.images = images
        self.reservations = reservations
        self.stream = stream
        self.clock = clock
        self.policy = policy
        self.log_keep = log_keep
        self.secret_box = secret_box
        self.rows = rows
        self.commits = GroupCommit(store, commit_writer)
        # Machines whose durable row lags behind `rows` by a lazy step (see fsm.Transition).
        self._dirty: set[str] = set()
        self._compacting = False
        self._op_tracer = op_tracer
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._listeners: list[Callable[[str], None]] = []
        self._log_reads = asyncio.Semaphore(LOG_READS)
        self.closing = False

    # --- start and stop ---------------------------------------------------

    def recover(self) -> int:
        """Load every row and resume unfinished operations. Returns how many were resumed."""
        stripped: dict[str, bytes] = {}
        for machine_id, raw in self.store.rows().items():
            row = fsm.decode_row(raw)
            if row.state == S.MACHINE_STATE_DESTROYED:
                # Destroyed by a flyd from before destroyed rows were stripped, it still holds
                # its whole config: it would weigh on every snapshot until it is dropped.
                slim = fsm.tombstone(row)
                if slim != row:
                    row = slim
                    stripped[machine_id] = fsm.encode_row(row)
            self.rows[machine_id] = row
            self.reservations.account(None, row)
            if row.state != S.MACHINE_STATE_DESTROYED:
                self.images.use(row.image_digest)
            self._tell(machine_id)
        if stripped:
            # Before anything else is committed: nothing writes concurrently yet.
            self.store.commit([], stripped)
            log.info("destroyed_rows_stripped", machines=len(stripped))
        resumed = 0
        for machine_id, row in self.rows.items():
            alive = False
            if row.handle is not None:
                # A process that is gone is reported through on_exit with its real status.
                alive = self.driver.attach(machine_id, Handle.from_dict(row.handle))
            if row.op is not None and (alive or row.handle is None):
                self.spawn_task(self.drive(machine_id, fsm.Resume(alive=alive)))
                resumed += 1
        # The driver holds the published ports again (and lets go of what nothing owns).
        services = {
            mid: published(row.machine)
            for mid, row in self.rows.items()
            if row.state != S.MACHINE_STATE_DESTROYED
        }
        self.spawn_task(self.driver.reconcile(services))
        # What a create left on the host when flyd died before its first commit.
        for machine_id in self.driver.leftovers():
            kept = self.rows.get(machine_id)
            if kept is None or kept.state == S.MACHINE_STATE_DESTROYED:
                self.spawn_task(self.clean_leftover(machine_id))
        log.info("recovered", machines=len(self.rows), resumed=resumed, seq=self.store.last_seq())
        return resumed

    async def clean_leftover(self, machine_id: str) -> None:
        """Remove what the driver keeps for a machine that has no row (a create that never
        committed: flyd died, or its caller left, mid-create), unless one is made meanwhile."""
        async with self.lock(machine_id):
            row = self.rows.get(machine_id)
            if row is not None and row.state != S.MACHINE_STATE_DESTROYED:
                return  # created again meanwhile: it is a machine now
            with contextlib.suppress(FailedPrecondition):  # still running: it stays
                await self.driver.stop(machine_id, signal.SIGKILL, 0)
            await self.driver.cleanup(machine_id)
            log.info("leftover_removed", machine_id=machine_id)

    async def close(self, *, flush: bool = False) -> None:
        """Stop background work (machines keep running), commit the lazy rows if `flush`, and
        stop the log's writer once what it was given is written."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if flush:
            await self.flush()
        await self.commits.close()

    def listen(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(machine_id)` whenever a machine's row changes in memory (each durable
        commit, and each row `recover` loads); it must be quick and must not block. Lazy steps
        (fsm.Transition) are not told: they change neither the state nor the process. Returns
        what stops it."""
        self._listeners.append(listener)
        return functools.partial(self._listeners.remove, listener)

    def _tell(self, machine_id: str) -> None:
        for listener in self._listeners:
            listener(machine_id)

    def on_exit(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        """The driver's exit callback: turn it into an Exited event (`_exited`)."""
        if self.closing or machine_id not in self.rows:
            return
        self.spawn_task(self._exited(machine_id, handle, status))

    async def _exited(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        """Step the machine with its exit and the last lines it printed. The lock first, as
        any step takes it: the exit keeps its place before steps asked for after it."""
        async with self.lock(machine_id):
            tail: tuple[str, ...] = ()
            with contextlib.suppress(Exception):
                said = await self.read_logs(machine_id, EXIT_TAIL_LINES, EXIT_TAIL_BYTES)
                # Cut, each line: the row (and every snapshot) must not grow with what it said.
                tail = tuple(line[:LOG_TAIL_CHARS] for line in said.lines)
            event = fsm.Exited(
                handle.to_dict(),
                status.exit_code,
                status.signal,
                status.oom_killed,
                tail,
                released=status.released,
            )
            await self.drive_locked(machine_id, event)

    async def read_logs(self, machine_id: str, tail_lines: int, max_bytes: int) -> LogTail:
        """The machine's last `tail_lines` log lines, read in a thread (no other call waits
        on it), at most `max_bytes` of the log, and at most `LOG_READS` reads at once."""
        async with self._log_reads:
            return await asyncio.to_thread(self.driver.read_logs, machine_id, tail_lines, max_bytes)

    def spawn_task(self, coro: Awaitable[None]) -> None:
        """Run `coro` in the background; `close` cancels it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background step failed", exc_info=task.exception())

    # --- the drive loop ---------------------------------------------------

    def lock(self, machine_id: str) -> asyncio.Lock:
        """The lock that serialises every change of one machine."""
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
        async with self.lock(machine_id):
            if lease_nonce is not None:
                fsm.check_lease(self.rows[machine_id], lease_nonce, self.clock.now())
            await self.drive_locked(machine_id, event, op_span=op_span)

    async def drive_locked(
        self,
        machine_id: str,
        event: fsm.Event | None,
        staged: list[fsm.Transition] | None = None,
        *,
        op_span: tuple[str, OpSpan] | None = None,
        commit_by: float | None = None,
    ) -> None:
        """Step the machine until it rests, committing each step before its effects run.

        The caller holds the machine's lock. A step whose one effect is Spawn is the
        exception: the driver's spawn holds the new process before it runs anything, so the
        step is committed together with the spawn's outcome (one transaction instead of two).
        A crash before that commit leaves a held process that dies with flyd, and the last
        committed step is resumed as before. `staged` are steps computed but not committed
        yet (a create's first ones). `op_span` (op, span) receives the steps from the first
        commit on, in place of any open one. `commit_by` (loop time): the first commit must
        come before it, else DeadlineExceeded and nothing is committed (the caller is gone).
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
                self._check_in_time(machine_id, commit_by)
                commit_by = None
                await self.commit(machine_id, staged)
                staged = []
                event = await self._perform(machine_id, transition)
            if staged:
                if op_span is not None:
                    self._take_span(machine_id, op_span)
                self._check_in_time(machine_id, commit_by)
                await self.commit(machine_id, staged)
                staged = []
        finally:
            if staged and staged[-1].row.handle is not None:
                # Spawned but never committed: the held process must not run.
                self.driver.discard(machine_id)

    @staticmethod
    def _check_in_time(machine_id: str, commit_by: float | None) -> None:
        if commit_by is not None and asyncio.get_running_loop().time() > commit_by:
            raise DeadlineExceeded(
                f"machine {machine_id}: the caller's deadline passed before its first commit; "
                "nothing was created"
            )

    def _apply_lazy(self, machine_id: str, t: fsm.Transition) -> None:
        """A change of flyd's internals that may become durable later (see fsm.Transition).

        It rides along with the next commit of any machine, or `flush`.
        """
        self.rows[machine_id] = t.row
        self._dirty.add(machine_id)
        if self._op_tracer is not None and t.row.op is None:
            self._op_tracer.rested(machine_id)

    async def flush(self) -> None:
        """Commit the rows whose durable copy lags behind (lazy steps); flyd calls it often."""
        if self._dirty:
            rows = self._take_dirty()
            done = self.commits.submit([], rows)
            done.add_done_callback(functools.partial(self._redirty, list(rows)))
            await durable(done)

    def _take_dirty(self) -> dict[str, bytes]:
        """The lazy rows, to ride along with a commit: dirty again if that commit fails."""
        dirty = {mid: fsm.encode_row(self.rows[mid]) for mid in self._dirty}
        self._dirty.clear()
        return dirty

    def _redirty(self, ids: Iterable[str], done: asyncio.Future[int]) -> None:
        if done.exception() is not None:
            self._dirty.update(mid for mid in ids if mid in self.rows)

    def _take_span(self, machine_id: str, op_span: tuple[str, OpSpan]) -> None:
        if self._op_tracer is not None:
            self._op_tracer.attach(machine_id, op_span[1], op_span[0])

    # --- effects ------------------------------------------------------------

    async def _spawn(self, machine_id: str, row: fsm.Row) -> fsm.Event:
        try:
            handle = await self.driver.start(process_spec(row, self.images, self.secret_box))
        except Exception as err:  # any failure to spawn is the machine's, not ours
            log.warning("spawn failed", machine_id=machine_id, error=str(err))
            return fsm.SpawnFailed(str(err))
        return fsm.Spawned(handle.to_dict(), self.driver.machine_address(machine_id))

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
                    self.spawn_task(self._kill(machine_id, row.handle, sig, timeout))
                case fsm.SendSignal(signal=sig):
                    with contextlib.suppress(NotFound):
                        await self.driver.signal(machine_id, sig)
                    next_event = fsm.Signalled()
                case fsm.Cleanup():
                    try:
                        await self.driver.cleanup(machine_id)
                    except Exception as err:  # retried with a backoff (fsm.CleanupFailed)
                        log.warning(
                            "cleanup failed",
                            machine_id=machine_id,
                            state=fsm.state_name(row.state),
                            error=str(err)[:200],
                            attempt=(row.op.attempts + 1) if row.op else 1,
                        )
                        CLEANUP_FAILURES.inc()
                        next_event = fsm.CleanupFailed(str(err)[:200])
                    else:
                        next_event = fsm.CleanedUp()
                case fsm.StartTimer(at=when):
                    self.spawn_task(self._timer(machine_id, when))
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

    # --- commits ------------------------------------------------------------

    async def commit(self, machine_id: str, steps: list[fsm.Transition]) -> None:
        """One commit: a log record per step and the row after the last. Once it is durable,
        and not before, tell all (`_committed`), then return; the effects come after. The
        caller holds the machine's lock, and keeps it until then even when it is cancelled
        meanwhile: the row in memory is never behind or ahead of the log.

        Steps computed together (a step and its spawn's outcome) are committed together; each
        record still carries the machine as it was after its own step.
        """
        records, changes = self._records(machine_id, steps, self.commits.assigned)
        rows = self._take_dirty()
        lazy = list(rows)
        rows[machine_id] = fsm.encode_row(steps[-1].row)
        done = self.commits.submit(records, rows)
        if lazy:
            done.add_done_callback(functools.partial(self._redirty, lazy))
        try:
            await durable(done)
        finally:
            # Here, not in a callback of the writer: nothing runs between telling all and
            # this task's next effects (a waiter woken by the change finds them done).
            if done.done() and done.exception() is None:
                self._committed(machine_id, steps, changes, done.result())
        if self.store.last_seq() - self.store.first_seq() >= 2 * self.log_keep:
            await self._compact()

    def commit_now(self, machine_id: str, steps: list[fsm.Transition]) -> None:
        """`commit`, written at once on the loop: for recovery, before anything else commits."""
        records, changes = self._records(machine_id, steps, self.commits.assigned)
        rows = self._take_dirty()
        rows[machine_id] = fsm.encode_row(steps[-1].row)
        self._committed(machine_id, steps, changes, self.commits.commit_now(records, rows))

    def _records(
        self, machine_id: str, steps: list[fsm.Transition], seq: int
    ) -> tuple[list[NewRecord], list[worker_pb2.MachineChange]]:
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
                generation=machine.slot.generation,
            )
            if t.from_state != t.to_state:
                machine.events.append(event)
                if len(machine.events) > fsm.EVENT_TAIL:
                    del machine.events[: len(machine.events) - fsm.EVENT_TAIL]
            tail = machine.events
            changes.append(worker_pb2.MachineChange(event=event, machine=machine))
        records = [NewRecord(RecordType.MACHINE_CHANGE, c.SerializeToString()) for c in changes]
        return records, changes

    def _committed(
        self,
        machine_id: str,
        steps: list[fsm.Transition],
        changes: list[worker_pb2.MachineChange],
        seq: int,
    ) -> None:
        """What follows a durable commit: the row in memory, reservations, images, metrics, the
        operation's span, the log line, the stream, compaction."""
        row = steps[-1].row
        self.reservations.account(self.rows.get(machine_id), row)
        self.rows[machine_id] = row
        self.reservations.pending.pop(machine_id, None)  # a create's reservation is now the row's
        op_span = None
        for t, change in zip(steps, changes, strict=True):
            op_span = self._step_committed(machine_id, t, change.event.seq) or op_span
        if op_span is None:
            self._log_commit(machine_id, steps, seq)
        else:
            with op_span.current():  # the line carries the operation's trace, even in a task
                self._log_commit(machine_id, steps, seq)
        for change in changes:
            self.stream.publish(change)
        self._tell(machine_id)

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

    def _step_committed(self, machine_id: str, t: fsm.Transition, seq: int) -> OpSpan | None:
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

    async def drop(self, machine_ids: list[str]) -> None:
        """Forget destroyed machines: their rows leave the store (one commit) and memory."""
        if machine_ids:
            await durable(
                self.commits.submit(
                    [], dict.fromkeys(machine_ids), lambda _: self._forget(machine_ids)
                )
            )

    def _forget(self, machine_ids: list[str]) -> None:
        for mid in machine_ids:
            row = self.rows.pop(mid, None)
            if row is not None:
                self.reservations.account(row, None)
            lock = self._locks.get(mid)
            if lock is not None and not lock.locked():  # (a holder's waiters keep theirs)
                del self._locks[mid]

    async def _compact(self) -> None:
        if self._compacting:  # another commit's task does it
            return
        self._compacting = True
        try:
            destroyed = [
                (row.machine.updated_at.ToNanoseconds(), mid)
                for mid, row in self.rows.items()
                if row.state == S.MACHINE_STATE_DESTROYED
            ]
            drop = [mid for _, mid in sorted(destroyed)[: max(0, len(destroyed) - KEEP_DESTROYED)]]
            await self.drop(drop)
            keep = self.log_keep
            dropped = await self.commits.run(lambda store: store.compact(keep))
        finally:
            self._compacting = False
        log.info(
            "log compacted",
            dropped=dropped,
            first_seq=self.store.first_seq(),
            destroyed_rows_dropped=len(drop),
        )
