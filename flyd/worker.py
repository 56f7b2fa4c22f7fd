"""The worker: the operations callers ask of this flyd's machines, over the runner.

One `Worker` per flyd, wired from its parts: flyd.runner (the rows and the loop that commits
each step before its effects, recovery after a restart), flyd.reservations (capacity and
host ports), flyd.stream (WatchEvents, waits, the log's history) and flyd.spec (what a
machine's process is). Here: checking a request and turning it into the event the runner
drives (create, start, stop, restart, signal, destroy, update), leases, waits, cordoning,
and what the worker reports of itself (info, capacity, heartbeats). The gRPC servicer
(flyd.service) and flyd.main call only this class.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from flyd import fsm
from flyd.commits import Writer
from flyd.drivers.base import Driver, ExitStatus, Handle
from flyd.fencing import Fencing, SlotPeers
from flyd.images.cache import ImageCache
from flyd.metrics import CREATE_SECONDS
from flyd.readiness import Readiness, probe_host
from flyd.reservations import Reservations
from flyd.runner import Runner
from flyd.secrets import REDACTED, SecretBox, SecretsUnreadable
from flyd.settings import CapacitySettings
from flyd.spec import argv, published
from flyd.store import MachineLog
from flyd.stream import EventStream
from flyd.traces import OpSpan, OpTracer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model import scope
from model.errors import (
    DESTROYED,
    REPLACED,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from model.validate import check_config, check_disk_change, check_network
from runtime.clock import Clock
from runtime.entropy import SYSTEM, Entropy
from runtime.validate import check_name

log = structlog.get_logger("flyd.worker")
# How long before its caller's deadline a create must commit, for its answer to reach them.
COMMIT_MARGIN = 0.005
S = pb.MachineState
# The longest idempotency key a create may carry (as flaps' and the wire's bound).
MAX_KEY = 256


@dataclass
class Identity:
    worker_id: str
    region: str
    address: str
    labels: dict[str, str]
    boot_id: str


class Worker:
    """All machines of this worker: the operations on them, and what it reports of itself."""

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
        op_tracer: OpTracer | None = None,
        peers: SlotPeers | None = None,
        fence_after: float = 0.5,
        monotonic: Callable[[], float] = time.monotonic,
        secret_box: SecretBox | None = None,
        ready_grace: float = 10.0,
        ready_settle: float = 1.0,
        entropy: Entropy = SYSTEM,
        commit_writer: Writer | None = None,
    ) -> None:
        """`op_tracer`: spans of machine operations; None (tracing off) costs nothing.
        `peers`: how a returning worker confirms its slots (flyd.fencing); `fence_after`: how
        long away (frozen, starved) counts as having been away. `secret_box`: seals machine
        secrets (flyd.main's is the worker's key file; without one, a key of this Worker's own
        that is never stored). `ready_grace`, `ready_settle`: see flyd.readiness (its loop is
        `readiness.run`, which flyd.main runs). `entropy`: where machine ids, instance ids and
        lease nonces come from (runtime.entropy; a simulated worker's is seeded).
        `commit_writer`: who writes the store's transactions (flyd.commits: by default a
        thread of its own for a blocking store; a simulated disk brings its own)."""
        self.entropy = entropy
        self.identity = identity
        self.store = store
        self.driver = driver
        self.images = images
        self.total = capacity
        self.machine_host = machine_host
        self.clock = clock
        self._state_dir = state_dir
        self._op_tracer = op_tracer
        self.secret_box = secret_box or SecretBox.ephemeral()
        self.rows: dict[str, fsm.Row] = {}
        self.stream = EventStream(store, self.heartbeat)
        self.reservations = Reservations(
            worker_id=identity.worker_id,
            total=capacity,
            rows=self.rows,
            ports=ports,
            machine_host=machine_host,
            hold_ports=driver.hold_ports,
        )
        self.runner = Runner(
            rows=self.rows,
            store=store,
            driver=driver,
            images=images,
            reservations=self.reservations,
            stream=self.stream,
            clock=clock,
            policy=policy,
            log_keep=log_keep,
            op_tracer=op_tracer,
            secret_box=self.secret_box,
            commit_writer=commit_writer,
        )
        self.readiness = Readiness(
            rows=self.rows,
            runner=self.runner,
            clock=clock,
            grace=ready_grace,
            settle=ready_settle,
            host=probe_host(machine_host),
        )
        self.fencing = Fencing(
            self.runner,
            clock,
            peers=peers,
            fence_after=fence_after,
            stop_params=lambda row: self._stop_params(row, None, None),
            monotonic=monotonic,
        )
        self.stream.before_heartbeat = self.fencing.check_awake
        self._recovered = asyncio.Event()
        # Creates under way until their maker is done with them (answered, or rolled back);
        # those of them answered to another caller meanwhile (a retry under the same key that
        # waited for it: never rolled back, whoever gave up); and creates being rolled back
        # (a retry does not get those: it hears to try again).
        self._making: set[str] = set()
        self._waiters: collections.Counter[str] = collections.Counter()
        self._answered: set[str] = set()
        self._rolling_back: set[str] = set()
        # Creates under a key, by the id they name, from their arrival until they return:
        # heartbeats list them (flaps places no such key elsewhere meanwhile) and GetMachine
        # of one without a row yet answers UNAVAILABLE, not NOT_FOUND.
        self._creating: collections.Counter[str] = collections.Counter()
        self.cordoned = bool(state_dir and (state_dir / "cordoned").exists())

    # --- start and stop ---------------------------------------------------

    def recover(self) -> int:
        """Load every row, resume unfinished operations and fence every slot primary it runs
        (flyd.fencing): it may have been superseded while flyd was down. Until this ran,
        watchers wait. Returns how many operations were resumed."""
        resumed = self.runner.recover()
        fenced = self.fencing.fence_recovered()
        if fenced:
            log.info("fenced_on_start", machines=fenced)
        self._recovered.set()
        return resumed

    async def close(self, *, flush: bool = False) -> None:
        """Stop background work (machines keep running) and the log's writer; with `flush`,
        commit the lazy rows first (a clean stop; a killed flyd does not)."""
        await self.runner.close(flush=flush)
        self.stream.close()

    @property
    def closing(self) -> bool:
        return self.runner.closing

    def on_exit(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        """The driver's exit callback: turn it into an Exited event."""
        self.runner.on_exit(machine_id, handle, status)

    async def flush(self) -> None:
        """Commit the rows whose durable copy lags behind (lazy steps); flyd calls it often."""
        await self.runner.flush()

    # --- operations ---------------------------------------------------------

    def get(self, machine_id: str) -> fsm.Row:
        """The machine's row. Any id a row has is found, even one the name check refuses now
        (a row from before it was strict): what this worker accepted, it can also destroy."""
        if not machine_id:
            raise InvalidArgument("machine_id", "is required")
        row = self.rows.get(machine_id)
        if row is None:
            check_name("machine_id", machine_id)
            raise NotFound(f"machine {machine_id} not found on worker {self.identity.worker_id}")
        return row

    def answer(self, machine_id: str) -> pb.Machine:
        """The machine as a caller is answered with it (GetMachine: flaps answers a create
        under a key held here with it): not one being rolled back, whose caller gave up and
        that nobody else was told of: that one is as good as gone (UNAVAILABLE: retry). One
        still being made is kept from then on, whoever gives up (it was told of); one whose
        create came but has no row yet may still be made (UNAVAILABLE, not NOT_FOUND)."""
        if machine_id and machine_id not in self.rows and self._creating[machine_id]:
            raise Unavailable(f"machine {machine_id} is being created: ask again")
        row = self.get(machine_id)
        if machine_id in self._rolling_back:
            raise Unavailable(f"machine {machine_id} is being rolled back: its create failed")
        if machine_id in self._making:
            self._answered.add(machine_id)
        return row.machine

    def _held(self, machine_id: str) -> pb.Machine | None:
        """The row of a machine a call names, when this worker holds it (model.scope)."""
        row = self.rows.get(machine_id)
        return None if row is None else row.machine

    def reveal_secrets(self, machine_id: str) -> dict[str, str]:
        """The machine's secrets, opened (flaps copies them to a new machine of its app)."""
        row = self.get(machine_id)
        try:
            return self.secret_box.open_all(row.machine.id, row.secrets)
        except SecretsUnreadable as err:
            raise FailedPrecondition(str(err)) from None

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
        deadline: float | None = None,
        placement: pb.PlacementDecision | None = None,
        not_after: float | None = None,
    ) -> pb.Machine:
        """Create a machine and, unless skip_launch, start it; returns it at rest (STARTED).

        `placement`: why flaps chose this worker, kept with the machine (`placement()`).

        A create of `app` under an `idempotency_key` this worker holds returns the key's
        machine (whatever `machine_id` says, room or not); one under way is waited for.

        `deadline` (loop time): the caller's. Nothing is committed later than `COMMIT_MARGIN`
        before it (DeadlineExceeded: no machine), and a create committed for a caller who
        went away or whose deadline passed before the answer is rolled back (`roll_back`):
        DEADLINE_EXCEEDED means no machine. `not_after` (the clock's time): a create that
        arrives later is refused the same way, however long the caller's deadline is.
        """
        t0 = time.perf_counter()
        check_name("machine_id", machine_id, required=False)
        if len(idempotency_key) > MAX_KEY:
            raise InvalidArgument("idempotency_key", f"must be at most {MAX_KEY} characters")
        if not_after is not None and (late := self.clock.now() - not_after) > 0:
            raise DeadlineExceeded(
                f"the create arrived {late:.3f}s after its not_after: nothing was made"
            )
        # Named for its worker, as flaps names the machines it places: a call on it can be
        # routed by its id alone, wherever it was created.
        mid = machine_id or f"{self.identity.worker_id}-{self.entropy.token_hex(6)}"
        named = mid
        if idempotency_key:
            mid = self.reservations.keys.get((app, idempotency_key), mid)
            self._creating[named] += 1
        try:
            machine = await self._traced(
                "create",
                mid,
                app,
                lambda op_span: self._create(
                    mid,
                    name,
                    app,
                    config,
                    skip_launch,
                    idempotency_key,
                    op_span,
                    deadline,
                    b"" if placement is None else placement.SerializeToString(),
                ),
            )
        finally:
            if idempotency_key:
                self._creating[named] -= 1
                if not self._creating[named]:
                    del self._creating[named]
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
        deadline: float | None = None,
        placement: bytes = b"",
    ) -> pb.Machine:
        check_name("app", app)
        if len(name) > 63:
            raise InvalidArgument("name", "must be at most 63 characters")
        check_config(config)
        check_network(config, self.driver.egress_refusal)
        scope.check_held(app, scope.config_refs(config), self._held)
        if (existing := self._existing(machine_id, app, config)) is not None:
            return self._answer(existing)
        if machine_id in self.reservations.pending:
            # The same create is under way (a retry, or another flaps with the same key): its
            # outcome is ours, whatever room is left once it has reserved its own. While we
            # wait, its maker does not roll it back if its own caller gives up.
            self._waiters[machine_id] += 1
            try:
                async with self.runner.lock(machine_id):
                    if (existing := self._existing(machine_id, app, config)) is not None:
                        return self._answer(existing)
            finally:
                self._waiters[machine_id] -= 1
                if not self._waiters[machine_id]:
                    del self._waiters[machine_id]
        if self.cordoned or self.closing:
            raise Unavailable(
                f"worker {self.identity.worker_id} is "
                f"{'cordoned' if self.cordoned else 'shutting down'}"
            )
        self.reservations.check_room(config.guest)  # fail fast, before pulling anything
        # Only an image the app may run (model.images.owners), known before anything is pulled.
        image = await self.images.pull(config.image, app=app)
        self.images.use(image.digest)  # at once, so the pulled image cannot be evicted
        mine = self.entropy.token_hex(8)  # the instance this call creates
        reached_driver = False
        making = False  # this call is the machine's maker (see _making)
        try:
            if not argv(config, image):
                raise InvalidArgument("config.cmd", "the image has no entrypoint or cmd; set one")
            # Another machine took the key while the image was pulled: its outcome is ours.
            held = self.reservations.keys.get((app, key), machine_id) if key else machine_id
            if held != machine_id:
                async with self.runner.lock(held):
                    existing = self._existing(held, app, config)
                    if existing is not None:
                        self._answer(existing)
                if existing is not None:
                    self.images.release(image.digest)
                    return existing
            async with self.runner.lock(machine_id):
                if (existing := self._existing(machine_id, app, config)) is not None:
                    self.images.release(image.digest)
                    return self._answer(existing)
                # The check and the reservation are atomic: the machine is reserved (as
                # pending) before the first await, and its first commit makes that its row's.
                self.reservations.check_room(config.guest)
                ports = self.reservations.allocate_ports(machine_id, len(config.services))
                reached_driver = True  # it holds ports for the machine, and may start it
                try:
                    kept, sealed = self.secret_box.take(machine_id, config)
                    machine = pb.Machine(
                        id=machine_id,
                        name=name or machine_id,
                        app=app,
                        region=self.identity.region,
                        worker_id=self.identity.worker_id,
                        config=kept,
                        instance_id=mine,
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
                        secrets=sealed,
                        placement=placement,
                    )
                    self.reservations.pending[machine_id] = machine
                    self._making.add(machine_id)
                    making = True
                    if key:
                        self.reservations.keys[(app, key)] = machine_id
                    # The pending start goes on in the same operation: its spawn comes before
                    # the first commit, which records the creation, the start and the process.
                    await self.runner.drive_locked(
                        machine_id,
                        fsm.Resume(alive=False),
                        [first],
                        op_span=op_span,
                        commit_by=None if deadline is None else deadline - COMMIT_MARGIN,
                    )
                finally:
                    self.reservations.pending.pop(machine_id, None)
                    # Its ports stay held if the create was committed, else they go.
                    await self._publish(machine_id)
        except BaseException as err:
            row = self.rows.get(machine_id)
            rolls_back = (
                row is not None
                and isinstance(err, asyncio.CancelledError)
                and row.machine.instance_id == mine
            )
            if making and not rolls_back:
                self._made(machine_id)
            if row is None:
                self.images.release(image.digest)
                if self.reservations.keys.get((app, key)) == machine_id:
                    del self.reservations.keys[(app, key)]
                if reached_driver and isinstance(err, Exception | asyncio.CancelledError):
                    # Nothing committed: what the driver made for it (a run dir, a slot,
                    # netd's namespaces, a held container) goes, as after a crash. (Not as
                    # flyd itself dies: a new flyd sees what its commits left.)
                    self.runner.spawn_task(self.runner.clean_leftover(machine_id))
            elif rolls_back:
                # Committed by this call, but its caller is gone (deadline, cancel): it never
                # hears of the machine, unless a retry did meanwhile (`_roll_back_unless_told`).
                self._roll_back_unless_told(machine_id)
            raise
        # Ready within the margin of the deadline, the answer would reach the caller too late.
        if deadline is not None and asyncio.get_running_loop().time() >= deadline - COMMIT_MARGIN:
            self._roll_back_unless_told(machine_id)
            raise DeadlineExceeded(
                f"machine {machine_id} was ready too late to answer its caller in time; rolled back"
            )
        if making:
            self._made(machine_id)
        return self.rows[machine_id].machine

    def _roll_back_unless_told(self, machine_id: str) -> None:
        """The maker's caller is gone: roll the create back, unless another caller was told
        of the machine or waits for it (then it is theirs). From then on nobody is."""
        told = machine_id in self._answered or self._waiters[machine_id] > 0
        self._made(machine_id)
        if told:
            log.info("create kept", machine_id=machine_id, reason="a retry was told of it")
            return
        self._rolling_back.add(machine_id)
        self.runner.spawn_task(self.roll_back(machine_id))

    def _made(self, machine_id: str) -> None:
        """The maker of a create is done with it, and will not roll it back."""
        self._making.discard(machine_id)
        self._answered.discard(machine_id)

    async def _publish(self, machine_id: str) -> None:
        """Have the driver hold exactly the host ports the machine's row has (none without a
        row): after a create or an update, committed or not.
        """
        row = self.rows.get(machine_id)
        ports = published(row.machine) if row is not None else ()
        try:
            await self.driver.publish(machine_id, ports)
        except Exception as e:  # the operation's own outcome is what the caller hears of
            log.error("machine_ports_not_published", machine_id=machine_id, error=str(e))

    def _answer(self, existing: pb.Machine) -> pb.Machine:
        """`existing`, as the answer to a create that did not make it (under the machine's
        lock, where it checked): a retry told of the machine owns it as much as its maker."""
        if existing.id in self._rolling_back:
            raise Unavailable(f"machine {existing.id} is being rolled back: retry the create")
        if existing.id in self._making:
            self._answered.add(existing.id)
        return existing

    async def roll_back(self, machine_id: str, timeout: float = 60.0) -> None:
        """Undo a create whose caller is gone: destroy the machine, then drop its row, so that
        the id is free again (a retry with it creates the machine anew). Meanwhile nobody is
        answered with it (`_answer`, `answer`)."""
        self._rolling_back.add(machine_id)
        try:
            async with self.runner.lock(machine_id):
                log.warning(
                    "create rolled back", machine_id=machine_id, reason="its caller is gone"
                )
                await self.runner.drive_locked(machine_id, fsm.DestroyRequested(force=True))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (row := self.rows.get(machine_id)) is not None:
                if row.state == S.MACHINE_STATE_DESTROYED:
                    async with self.runner.lock(machine_id):
                        await self.runner.drop([machine_id])
                    return
                if loop.time() >= deadline:
                    log.error("roll back unfinished", machine_id=machine_id, state=row.state)
                    return
                await self.stream.changed(deadline - loop.time())
        finally:
            self._rolling_back.discard(machine_id)

    def _existing(self, machine_id: str, app: str, config: pb.MachineConfig) -> pb.Machine | None:
        row = self.rows.get(machine_id)
        if row is None:
            return None
        kept = row.machine.config
        if row.state == S.MACHINE_STATE_DESTROYED:  # its row keeps only the image and size
            same = kept.image == config.image and kept.guest == config.guest
        else:
            # The row has the secrets' names only: the values are compared with the sealed.
            redacted = pb.MachineConfig()
            redacted.CopyFrom(config)
            for name in redacted.secrets:
                redacted.secrets[name] = REDACTED
            same = kept == redacted and self.secret_box.same(machine_id, row.secrets, config)
        if row.machine.app != app or not same:
            raise AlreadyExists(f"machine {machine_id} exists with another app or config")
        return row.machine

    async def _operate(
        self, op: str, machine_id: str, event: fsm.Event, lease_nonce: str | None
    ) -> pb.Machine:
        """Run one requested operation on a machine; traced as `flyd.<op>` when tracing is on."""

        async def run(op_span: tuple[str, OpSpan] | None) -> pb.Machine:
            await self.runner.drive(machine_id, event, lease_nonce=lease_nonce, op_span=op_span)
            return self.rows[machine_id].machine

        return await self._traced(op, machine_id, self.get(machine_id).machine.app, run)

    async def start(
        self, machine_id: str, *, lease_nonce: str = "", generation: int = 0
    ) -> pb.Machine:
        """Start the machine; with a generation, promote it in its slot first (a failover is
        not held up by a lease: the lease's holder cannot serve the slot either)."""
        if generation:
            event = fsm.StartRequested(generation)
            return await self._operate("promote", machine_id, event, None)
        return await self._operate("start", machine_id, fsm.StartRequested(), lease_nonce)

    async def supersede(
        self, machine_id: str, generation: int, primary: str, primary_app: str
    ) -> pb.Machine:
        """`primary` (of `primary_app`) serves the machine's slot at `generation`: if that
        outranks the machine's claim, it stops and stands by (model.slots). Not held up by a
        lease. Only a member of the machine's own app's slot may (model.scope)."""
        if generation < 1:
            raise InvalidArgument("generation", "must be at least 1")
        check_name("primary", primary)
        row = self.get(machine_id)
        scope.check_member(row.machine, primary, primary_app, self._held(primary))
        sig, timeout = self._stop_params(row, None, None)
        event = fsm.Supersede(generation, primary, sig, timeout)
        machine = await self._operate("supersede", machine_id, event, None)
        self.fencing.poke()
        return machine

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
        check_network(config, self.driver.egress_refusal)
        app = self.get(machine_id).machine.app
        scope.check_held(app, scope.config_refs(config), self._held)
        return await self._traced(
            "update",
            machine_id,
            app,
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
        check_disk_change(row.machine.config.guest, config.guest)
        self.reservations.check_room(config.guest, instead_of=row.machine.config.guest)  # fail fast
        # The new instance's image is checked as a create's is, whether or not it changed.
        image = await self.images.pull(config.image, app=row.machine.app)
        self.images.use(image.digest)
        instance_id = self.entropy.token_hex(8)
        old_digest = row.image_digest
        try:
            if not argv(config, image):
                raise InvalidArgument("config.cmd", "the image has no entrypoint or cmd; set one")
            async with self.runner.lock(machine_id):
                row = self.rows[machine_id]
                fsm.check_lease(row, lease_nonce, self.clock.now())
                # No await from here to the commit: the check and the reservation are atomic.
                check_disk_change(row.machine.config.guest, config.guest)
                self.reservations.check_room(config.guest, instead_of=row.machine.config.guest)
                old_digest = row.image_digest
                sig, timeout = self._stop_params(row, None, None)
                kept, sealed = self.secret_box.take(machine_id, config, row.secrets)
                event = fsm.UpdateRequested(
                    config=kept,
                    secrets=sealed,
                    instance_id=instance_id,
                    image_digest=image.digest,
                    ports=tuple(self.reservations.remap_ports(row, config)),
                    launch=not skip_launch,
                    stop_signal=sig,
                    stop_timeout=timeout,
                )
                try:
                    await self.runner.drive_locked(machine_id, event, op_span=op_span)
                finally:
                    await self._publish(machine_id)  # the ports the row has now
        except BaseException:
            # Cancelled after the commit, the row already holds the new image: drop the old.
            now = self.rows.get(machine_id)
            committed = now is not None and now.machine.instance_id == instance_id
            self.images.release(old_digest if committed else image.digest)
            raise
        self.images.release(old_digest)
        return self.rows[machine_id].machine

    async def acquire_lease(
        self, machine_id: str, *, ttl: float, owner: str, description: str, nonce: str
    ) -> pb.Lease:
        """Take (or refresh) the machine's lease; the response is the only place its nonce shows."""
        self.get(machine_id)
        async with self.runner.lock(machine_id):
            t = fsm.acquire_lease(
                self.rows[machine_id],
                new_nonce=self.entropy.token_hex(16),
                nonce=nonce,
                ttl=ttl,
                owner=owner,
                description=description,
                now=self.clock.now(),
            )
            await self.runner.commit(machine_id, [t])
        lease = self.rows[machine_id].lease
        assert lease is not None
        out = pb.Lease()
        out.CopyFrom(self.rows[machine_id].machine.lease)
        out.nonce = lease["nonce"]
        return out

    async def release_lease(self, machine_id: str, nonce: str) -> None:
        self.get(machine_id)
        async with self.runner.lock(machine_id):
            t = fsm.release_lease(self.rows[machine_id], nonce, self.clock.now())
            if t is not None:
                await self.runner.commit(machine_id, [t])

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
        self,
        machine_id: str,
        state: int,
        timeout: float,
        instance_id: str = "",
        *,
        ready: bool = False,
    ) -> pb.Machine:
        """Until the machine is in `state` (as `instance_id`, when given; with `ready`, started
        and ready: Machine.ready). DeadlineExceeded says where it is and, with `ready`, why it
        is not ready; waiting for ready on a failed machine is FailedPrecondition at once."""
        if state == S.MACHINE_STATE_UNSPECIFIED or state not in pb.MachineState.values():
            raise InvalidArgument("state", "must name a machine state")
        if ready and state != S.MACHINE_STATE_STARTED:
            raise InvalidArgument("ready", "applies only to waiting for state started")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            row = self.get(machine_id)
            if (
                row.state == state
                and (not instance_id or row.machine.instance_id == instance_id)
                and (not ready or row.machine.ready.ready)
            ):
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
            if ready and row.state == S.MACHINE_STATE_FAILED:
                raise FailedPrecondition(
                    f"machine {machine_id} failed; it will not be ready: {row.machine.ready.reason}"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                if ready:
                    raise DeadlineExceeded(self._not_ready(row, timeout))
                raise DeadlineExceeded(
                    f"machine {machine_id} is {fsm.state_name(row.state)}, not "
                    f"{fsm.state_name(state)}, after {timeout:g}s"
                )
            await self.stream.changed(remaining)

    def _not_ready(self, row: fsm.Row, timeout: float) -> str:
        """Why a wait for ready ran out: the row's condition, or what its probes say now."""
        mid = row.machine.id
        why = row.machine.ready.reason
        live = self.readiness.detail(mid) if row.state == S.MACHINE_STATE_STARTED else ""
        if live and live not in why:
            # While it starts, the row says what it waits for; the probes say why it waits.
            why = live if not why or why.startswith("starting") else f"{why}; now: {live}"
        return (
            f"machine {mid} is {fsm.state_name(row.state)}, not ready after {timeout:g}s: "
            f"{why or 'no reason known'}"
        )

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

    # --- what the worker reports --------------------------------------------

    def reserved(self) -> pb.Resources:
        """What the machines that are not destroyed reserve, plus creates under way."""
        return self.reservations.reserved()

    def machines_by_state(self) -> dict[int, int]:
        """How many machines (rows, destroyed ones included while kept) are in each state."""
        return self.reservations.machines_by_state()

    def capacity(self) -> pb.Capacity:
        return self.reservations.capacity(cordoned=self.cordoned, images=self.images.cached())

    def heartbeat(self) -> worker_pb2.Heartbeat:
        hb = worker_pb2.Heartbeat(
            seq=self.store.last_seq(),
            worker=self.info(),
            capacity=self.capacity(),
            log_epoch=self.store.epoch(),
            creating=sorted(self._creating),
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
        self,
        from_seq: int,
        *,
        heartbeat_interval: float,
        stop: asyncio.Event,
        log_epoch: str = "",
    ) -> AsyncIterator[worker_pb2.WatchEventsResponse]:
        """Every change after from_seq (or a snapshot first), then live, with heartbeats.

        Waits until the worker has recovered (and fenced what it runs): a follower must not
        hear a heartbeat before the fences."""
        await self._recovered.wait()
        async for item in self.stream.watch(
            from_seq, heartbeat_interval=heartbeat_interval, stop=stop, log_epoch=log_epoch
        ):
            yield item

    def placement(self, machine_id: str) -> pb.PlacementDecision | None:
        """The placement decision kept with the machine; None when it has none."""
        kept = self.get(machine_id).placement
        return pb.PlacementDecision.FromString(kept) if kept else None

    def events(self, machine_id: str) -> Iterator[pb.MachineEvent]:
        """The machine's state changes still in the log, oldest first."""
        self.get(machine_id)
        yield from self.stream.events(machine_id)
