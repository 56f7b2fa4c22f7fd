"""What the worker and crash tests share: a tiny image, machine configs, one flyd on a fake host.

A `Flyd` is what one flyd process owns: a Worker, its FakeDriver and its store. The FakeHost and
the ManualClock belong to the test (its `Node`): they outlive every Flyd, the way machines and
time outlive a killed flyd. `CrashingLog` kills a flyd right after a chosen commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

from flyd import fsm
from flyd.drivers.base import ExitStatus, Handle
from flyd.fakes import FakeDriver, FakeHost, FakeScript, _FakeProcess
from flyd.fencing import SlotPeers
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.secrets import SecretBox
from flyd.settings import CapacitySettings
from flyd.store import LmdbMachineLog, MachineLog, NewRecord, Record, Snapshot
from flyd.traces import OpTracer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from flyd.worker import Identity, Worker
from model.images.owners import PUBLIC
from model.images.source import ImageSource
from model.validate import DEFAULT_DISK_MIB
from runtime.clock import ManualClock

S = pb.MachineState
CREATED = S.MACHINE_STATE_CREATED
STARTED = S.MACHINE_STATE_STARTED
STOPPED = S.MACHINE_STATE_STOPPED
DESTROYED = S.MACHINE_STATE_DESTROYED
IMAGE = "app:v1"
# How long any test waits for a condition before it fails (never reached when things work).
DEADLINE = 5.0
# How often `until` looks again when no change is published.
RECHECK = 0.01
# Room for its 10 machines' disks at the default size (what a config's disk_mib 0 reserves).
CAPACITY = CapacitySettings(
    cpu_millicores=1000, memory_mib=1024, disk_mib=10 * DEFAULT_DISK_MIB, machines=10
)
PORTS = range(20000, 20010)
T = TypeVar("T")


def image_source(root: Path) -> ImageSource:
    """An image source holding `app:v1`, a one-file image whose entrypoint is `app`, public:
    every app of a test may run it."""
    src = root / "app-src"
    src.mkdir(parents=True)
    (src / "app").write_text("#!/bin/sh\n")
    build_image(src, root / "source", name="app", tag="v1", entrypoint=["app"], owners=PUBLIC)
    return ImageSource(root / "source")


def image_cache(root: Path, source: ImageSource) -> ImageCache:
    """One flyd's image cache; a restarted flyd opens a new one on the same root."""
    return ImageCache(root / "cache", source, max_bytes=1 << 30)


def config(
    *cmd: str,
    cpu: int = 100,
    memory: int = 128,
    services: int = 0,
    restart: int = pb.RESTART_MODE_UNSPECIFIED,
    max_retries: int = 0,
) -> pb.MachineConfig:
    """A machine of `app:v1`; `cmd` carries the fake: markers that script its process."""
    return pb.MachineConfig(
        image=IMAGE,
        guest=pb.GuestConfig(cpu_millicores=cpu, memory_mib=memory),
        cmd=list(cmd),
        services=[pb.ServiceConfig(internal_port=8080 + i) for i in range(services)],
        restart=pb.RestartPolicy(mode=restart, max_retries=max_retries),  # type: ignore[arg-type]
    )


class RecordingHost(FakeHost):
    """A FakeHost that remembers every process it ever spawned, to count how many ran."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.spawned: list[tuple[str, _FakeProcess]] = []

    def spawn(self, machine_id: str, script: FakeScript) -> Handle:
        handle = super().spawn(machine_id, script)
        self.spawned.append((machine_id, self.processes[machine_id]))
        return handle

    def ran(self, machine_id: str) -> int:
        """How many processes of the machine were released, i.e. ran its command."""
        return sum(1 for mid, p in self.spawned if mid == machine_id and p.released)

    def live_handle(self, machine_id: str) -> dict[str, object] | None:
        process = self.processes.get(machine_id)
        return None if process is None else dict(process.handle.to_dict())


class Crash(BaseException):
    """flyd dies here. A BaseException, so that no `except Exception` in flyd survives it."""


class CrashingLog:
    """A MachineLog that kills its flyd at the k-th commit once armed.

    By default the k-th commit is durable and the Crash comes right after it; with
    durable=False flyd dies just before writing it, after the effects of the step before. A
    dead flyd commits nothing more: later commits raise Crash unwritten. A commit here is one
    transaction of flyd's writer (flyd.commits), which may hold several operations' commits;
    it runs in the writer's thread, so `crashed` is set through the loop.
    """

    def __init__(self, inner: MachineLog) -> None:
        self.inner = inner
        self.blocking = inner.blocking
        self.commits = 0
        self.crash_at: int | None = None
        self.durable = True
        self.dead = False
        self.crashed = asyncio.Event()
        self.batches: list[list[int]] = []  # the seqs of each transaction's records
        self.before_commit: Callable[[], object] | None = None  # runs as each commit begins
        self._loop = asyncio.get_running_loop()

    def arm(self, k: int | None, *, durable: bool = True) -> None:
        """Crash at the k-th commit from now (None: only count them)."""
        self.commits = 0
        self.crash_at = k
        self.durable = durable

    def _die(self, why: str) -> NoReturn:
        self.dead = True
        self._loop.call_soon_threadsafe(self.crashed.set)
        raise Crash(why)

    def commit(self, records: Iterable[NewRecord], rows: Mapping[str, bytes | None]) -> int:
        if self.dead:
            raise Crash("flyd is dead")
        if self.before_commit is not None:
            self.before_commit()
        if self.commits + 1 == self.crash_at and not self.durable:
            self._die(f"flyd died just before commit {self.crash_at}")
        records = list(records)
        first = self.inner.last_seq() + 1
        seq = self.inner.commit(records, rows)
        self.batches.append(list(range(first, first + len(records))))
        self.commits += 1
        if self.commits == self.crash_at:
            self._die(f"flyd died right after commit {self.commits} (seq {seq})")
        return seq

    def epoch(self) -> str:
        return self.inner.epoch()

    def last_seq(self) -> int:
        return self.inner.last_seq()

    def first_seq(self) -> int:
        return self.inner.first_seq()

    def row(self, machine_id: str) -> bytes | None:
        return self.inner.row(machine_id)

    def rows(self) -> dict[str, bytes]:
        return self.inner.rows()

    def read(self, after_seq: int, limit: int = 1000) -> list[Record]:
        return self.inner.read(after_seq, limit)

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def compact(self, keep: int) -> int:
        return self.inner.compact(keep)

    def close(self) -> None:
        self.inner.close()


@dataclass
class Flyd:
    """One flyd process: a worker, the driver it watches machines through, its store."""

    worker: Worker
    driver: FakeDriver
    store: MachineLog

    async def kill(self) -> None:
        """flyd dies: its tasks stop, held processes die with the driver, the store closes."""
        await self.worker.close()
        await self.driver.close()
        self.store.close()


@dataclass
class Node:
    """What outlives every flyd a test boots on its root, as a host's machines, its clock and
    its disk outlive a killed flyd: the FakeHost, the ManualClock, the image source, the log
    at root/log. `kill_all` kills whichever of its flyds are still alive."""

    root: Path
    clock: ManualClock
    host: RecordingHost
    source: ImageSource
    booted: list[Flyd] = field(default_factory=list)

    def open_log(self) -> LmdbMachineLog:
        """The node's log, opened again (as each flyd process does)."""
        return LmdbMachineLog(self.root / "log")

    def boot(
        self,
        *,
        store: MachineLog | None = None,
        images: ImageCache | None = None,
        recover: bool = True,
        **overrides: Any,
    ) -> Flyd:
        """A flyd on this node, recovered unless `recover` is False: on `store` (else the
        node's log, opened again) and `images` (else a new cache on the root); `overrides` go
        to `boot`."""
        flyd = boot(
            store=self.open_log() if store is None else store,
            host=self.host,
            clock=self.clock,
            images=image_cache(self.root, self.source) if images is None else images,
            **overrides,
        )
        self.booted.append(flyd)
        if recover:
            flyd.worker.recover()
        return flyd

    async def kill_all(self) -> None:
        for flyd in self.booted:
            if not flyd.worker.closing:
                await flyd.kill()


class _ExitRelay:
    """The driver's on_exit, wired to a worker that is built after the driver."""

    worker: Worker | None = None

    def __call__(self, machine_id: str, handle: Handle, status: ExitStatus) -> None:
        if self.worker is not None:
            self.worker.on_exit(machine_id, handle, status)


def boot(
    *,
    store: MachineLog,
    host: FakeHost,
    clock: ManualClock,
    images: ImageCache,
    capacity: CapacitySettings = CAPACITY,
    ports: range = PORTS,
    log_keep: int = 10_000,
    policy: fsm.Policy | None = None,
    busy_ports: Iterable[int] = (),
    op_tracer: OpTracer | None = None,
    identity: Identity | None = None,
    peers: SlotPeers | None = None,
    monotonic: Callable[[], float] | None = None,
    secret_box: SecretBox | None = None,
    make_driver: Callable[[Callable[[str, Handle, ExitStatus], None]], Any] | None = None,
) -> Flyd:
    """A flyd on `host`, before recover(); worker w1 in ams unless `identity` says otherwise.
    `make_driver(on_exit)`: a real driver instead of the fake on `host`."""
    relay = _ExitRelay()
    host.busy_ports.update(busy_ports)  # taken by programs that are not machines
    driver = FakeDriver(on_exit=relay, host=host) if make_driver is None else make_driver(relay)
    worker = Worker(
        identity=identity or Identity("w1", "ams", "127.0.0.1:1", {}, "boot"),
        store=store,
        driver=driver,
        images=images,
        capacity=capacity,
        ports=ports,
        machine_host="127.0.0.1",
        clock=clock,
        policy=policy or fsm.Policy(),
        log_keep=log_keep,
        op_tracer=op_tracer,
        peers=peers,
        monotonic=monotonic or clock.now,
        secret_box=secret_box,
    )
    relay.worker = worker
    return Flyd(worker, driver, store)


async def until(worker: Worker, done: Callable[[], bool], timeout: float = DEADLINE) -> None:
    """Return once `done()` holds; fail at the deadline. Checked at every committed change and
    at least every `RECHECK` seconds between them: a lazy step (a start's release, riding along
    with a later commit: fsm.Transition) changes a row and publishes nothing, so a machine can
    settle after the last change there will be."""
    async with asyncio.timeout(timeout):
        while not done():
            await worker.stream.changed(RECHECK)


async def until_past_backoffs(
    clock: ManualClock, done: Callable[[], bool], timeout: float = 30.0
) -> None:
    """Return once `done()` holds, moving `clock` on past every sleep a machine waits in (a
    restart's backoff) whenever one is waited in: a recovery may schedule one after the
    test's last advance, later on a busy machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        assert loop.time() < deadline, "the worker did not settle"
        if clock.sleepers:
            clock.advance(60.0)
        await asyncio.sleep(0.005)


def settled(worker: Worker, machine_id: str, state: int) -> Callable[[], bool]:
    """The machine is in `state` with no operation left in progress."""

    def check() -> bool:
        row = worker.rows.get(machine_id)
        return row is not None and row.state == state and row.op is None

    return check


def log_changes(store: MachineLog) -> list[worker_pb2.MachineChange]:
    """Every kept record as a MachineChange; fails on a gap or a record numbered wrong."""
    out: list[worker_pb2.MachineChange] = []
    after = store.first_seq() - 1
    while batch := store.read(after, 1000):  # read() raises CorruptLog on a gap
        for rec in batch:
            change = worker_pb2.MachineChange.FromString(rec.body)
            assert change.event.seq == rec.seq
            out.append(change)
            after = rec.seq
    assert after == store.last_seq()
    return out


async def cancel_at_step(coro: Coroutine[Any, Any, Any], k: int) -> bool:
    """Run `coro` as a task and cancel it at its k-th await that suspends, as a caller's
    deadline would (the future it waits on is cancelled, CancelledError raised there, and
    whatever the code makes of that follows). False if it ended, or failed, in fewer steps:
    counting k up from 1 until then cancels it at every point it can be cancelled at.
    """
    steps = [0]
    task = asyncio.ensure_future(_stepped(coro, k, steps))
    with contextlib.suppress(Exception):  # its outcome: the caller checks what it left
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the test's own task was cancelled
    return steps[0] >= k


@types.coroutine
def _stepped(
    coro: Coroutine[Any, Any, T], cancel_at: int, steps: list[int]
) -> Generator[Any, Any, T]:
    """Drive `coro` as its task would, counting the futures it waits on; at the `cancel_at`-th
    it cancels the task while it is still running, so the task cancels that future."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            yielded = coro.send(sent) if thrown is None else coro.throw(thrown)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        steps[0] += 1
        if steps[0] == cancel_at:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
        sent, thrown = None, None
        try:
            sent = yield yielded
        except BaseException as e:  # passed on to the coroutine, as a task does
            thrown = e


# --- what the worker tests and the update and lease tests share --------------------------------


Boot = Callable[..., Flyd]


async def create(
    worker: Worker,
    machine_id: str,
    cfg: pb.MachineConfig | None = None,
    *,
    app: str = "web",
    skip_launch: bool = False,
    key: str = "",
) -> pb.Machine:
    return await worker.create(
        machine_id=machine_id,
        name="",
        app=app,
        config=cfg if cfg is not None else config(),
        skip_launch=skip_launch,
        idempotency_key=key,
    )


def held_pulls(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """The worker's image pulls wait for the returned event (a create held before it
    reserves anything)."""
    gate, pull = asyncio.Event(), worker.images.pull

    async def held(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await pull(*args, **kwargs)

    monkeypatch.setattr(worker.images, "pull", held)
    return gate


def history(events: Any) -> list[tuple[str, str, str]]:
    """(type, from state, to state) of each event."""
    name = {v: k.removeprefix("MACHINE_STATE_").lower() for k, v in S.items()}
    return [(e.type, name[e.from_state], name[e.to_state]) for e in events]


def image_refs(images: ImageCache) -> int:
    return sum(img.refs for img in images.cached())


class Stream:
    """A WatchEvents subscription read one item at a time, each with a deadline."""

    def __init__(
        self, worker: Worker, from_seq: int, heartbeat_interval: float = 3600, log_epoch: str = ""
    ) -> None:
        self.stop = asyncio.Event()
        items = worker.watch(
            from_seq, heartbeat_interval=heartbeat_interval, stop=self.stop, log_epoch=log_epoch
        )
        assert isinstance(items, AsyncGenerator)
        self._items = items

    async def next(self) -> worker_pb2.WatchEventsResponse:
        async with asyncio.timeout(DEADLINE):
            return await anext(self._items)

    async def next_kind(self) -> str:
        return (await self.next()).WhichOneof("item") or ""

    async def changes_until(self, seq: int) -> list[worker_pb2.MachineChange]:
        """Changes up to and including `seq`, skipping heartbeats."""
        out: list[worker_pb2.MachineChange] = []
        while not out or out[-1].event.seq < seq:
            item = await self.next()
            assert item.WhichOneof("item") != "snapshot"
            if item.HasField("change"):
                out.append(item.change)
        return out

    async def rest(self) -> list[str]:
        """The kinds of all items until the stream ends."""
        async with asyncio.timeout(DEADLINE):
            return [item.WhichOneof("item") or "" async for item in self._items]

    async def close(self) -> None:
        await self._items.aclose()
