"""The runner: a Worker on a FakeDriver, over both machine log backends.

Time is a ManualClock the tests advance; waits are on conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flyd import stream as stream_module
from flyd.drivers.base import ExitStatus, PortMapping
from flyd.settings import CapacitySettings
from flyd.v1 import machine_pb2 as pb
from flyd.worker import MAX_KEY, Worker
from model.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from model.validate import DEFAULT_DISK_MIB
from runtime.clock import ManualClock
from tests.flyd.support import (
    CAPACITY,
    DEADLINE,
    PORTS,
    Boot,
    Flyd,
    RecordingHost,
    Stream,
    config,
    create,
    held_pulls,
    history,
    image_refs,
    log_changes,
    until,
)

S = pb.MachineState
UNSPECIFIED = S.MACHINE_STATE_UNSPECIFIED
CREATED = S.MACHINE_STATE_CREATED
STARTING = S.MACHINE_STATE_STARTING
STARTED = S.MACHINE_STATE_STARTED
STOPPING = S.MACHINE_STATE_STOPPING
STOPPED = S.MACHINE_STATE_STOPPED
RESTARTING = S.MACHINE_STATE_RESTARTING
DESTROYED = S.MACHINE_STATE_DESTROYED
FAILED = S.MACHINE_STATE_FAILED


# --- the lifecycle ---------------------------------------------------------------------------


async def test_create_start_stop_destroy(flyd: Flyd, host: RecordingHost) -> None:
    w = flyd.worker
    created = await create(w, "m1", config(services=1))
    assert created.state == STARTED
    assert (created.name, created.worker_id, created.region) == ("m1", "w1", "ams")
    assert [(p.internal_port, p.host_port) for p in created.ports] == [(8080, PORTS[0])]
    (spec,) = flyd.driver.starts
    assert spec.argv == ["app"]
    assert spec.env["MACHINE_ID"] == "m1"
    assert spec.ports == (PortMapping(host_port=PORTS[0], internal_port=8080),)
    assert host.live_handle("m1") == w.get("m1").handle

    assert (await w.stop("m1", None, None)).state == STOPPING
    stopped = await w.wait("m1", STOPPED, DEADLINE)
    assert stopped.last_exit.signal == "SIGTERM"
    assert host.live_handle("m1") is None

    destroyed = await w.destroy("m1", force=False)
    assert destroyed.state == DESTROYED
    assert history(destroyed.events) == [
        ("create", "unspecified", "created"),
        ("start", "created", "starting"),
        ("start", "starting", "started"),
        ("stop", "started", "stopping"),
        ("stop", "stopping", "stopped"),
        ("destroy", "stopped", "destroying"),
        ("destroy", "destroying", "destroyed"),
    ]
    assert w.list_machines() == []
    assert [m.id for m in w.list_machines(include_destroyed=True)] == ["m1"]
    assert w.capacity().free == w.capacity().total
    assert image_refs(flyd.worker.images) == 0
    log_changes(flyd.store)


async def test_skip_launch_creates_without_starting(flyd: Flyd) -> None:
    created = await create(flyd.worker, "m1", skip_launch=True)
    assert created.state == CREATED
    assert flyd.driver.starts == []
    assert (await flyd.worker.start("m1")).state == STARTED


async def test_the_event_tail_keeps_the_newest(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1")
    for _ in range(5):
        await w.stop("m1", None, None)
        await w.wait("m1", STOPPED, DEADLINE)
        await w.start("m1")
    events = w.get("m1").machine.events
    assert len(events) == 10
    assert history(events)[-1] == ("start", "starting", "started")
    assert [e.seq for e in events] == sorted(e.seq for e in events)


async def test_create_is_idempotent_by_id(flyd: Flyd) -> None:
    w = flyd.worker
    first = await create(w, "m1", config("fake:exit_code=0"))
    seq = flyd.store.last_seq()
    again = await create(w, "m1", config("fake:exit_code=0"))
    assert (again.instance_id, again.state) == (first.instance_id, STARTED)
    assert (len(flyd.driver.starts), flyd.store.last_seq()) == (1, seq)
    with pytest.raises(AlreadyExists, match="m1"):
        await create(w, "m1", config("fake:exit_code=1"))
    with pytest.raises(AlreadyExists, match="m1"):
        await create(w, "m1", config("fake:exit_code=0"), app="other")
    assert image_refs(w.images) == 1


async def test_a_key_names_one_machine_on_this_worker(start_flyd: Boot) -> None:
    flyd = start_flyd(capacity=ONE)  # room for one machine
    w = flyd.worker
    first = await create(w, "m1", key="k1")
    assert first.idempotency_key == "k1"
    # Another id under the same key, with no room left: the key's machine, nothing new.
    again = await create(w, "m2", key="k1")
    assert (again.id, again.instance_id) == ("m1", first.instance_id)
    assert (len(flyd.driver.starts), "m2" in w.rows) == (1, False)
    # The key is per app, and a held key with another config is a conflict.
    with pytest.raises(ResourceExhausted):
        await create(w, "m3", app="other", key="k1")
    with pytest.raises(AlreadyExists, match="m1"):
        await create(w, "m2", config(cpu=200), key="k1")
    # It is durable: a flyd started again on the same store still holds it.
    await w.close()
    w = start_flyd(capacity=ONE).worker
    assert (await create(w, "m9", key="k1")).id == "m1"


@pytest.mark.parametrize("key", ["", "k1"], ids=["same-id", "same-key"])
async def test_a_second_create_under_way_waits_for_the_first(start_flyd: Boot, key: str) -> None:
    # Room for one: the second of two racing creates of the same machine must not be refused
    # for the room the first just reserved, or its flaps would try another worker.
    flyd = start_flyd(capacity=ONE)
    a, b = await asyncio.gather(
        create(flyd.worker, "m1", key=key), create(flyd.worker, "m1" if not key else "m2", key=key)
    )
    # Whichever got in first (under a key, the two ids differ), both name the one machine.
    assert a.id == b.id
    assert a.id in {"m1", "m2"}
    assert a.instance_id == b.instance_id
    assert len(flyd.driver.starts) == 1


async def test_a_keyed_create_arriving_after_its_not_after_makes_nothing(flyd: Flyd) -> None:
    # flaps gave up on it then, and may be placing the key elsewhere.
    seq, now = flyd.store.last_seq(), flyd.worker.clock.now()
    late = dict(name="", app="web", config=config(), skip_launch=False, idempotency_key="k1")
    with pytest.raises(DeadlineExceeded, match="after its not_after: nothing was made"):
        await flyd.worker.create(machine_id="m1", not_after=now - 0.5, **late)  # type: ignore[arg-type]
    assert (flyd.store.last_seq(), "m1" in flyd.worker.rows) == (seq, False)
    assert list(flyd.worker.heartbeat().creating) == []
    made = await flyd.worker.create(machine_id="m1", not_after=now + 5, **late)  # type: ignore[arg-type]
    assert made.state == STARTED


async def test_a_keyed_create_under_way_is_in_every_heartbeat_and_not_yet_not_found(
    flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = held_pulls(flyd.worker, monkeypatch)
    making = asyncio.create_task(create(flyd.worker, "w1-k", key="k1"))
    unkeyed = asyncio.create_task(create(flyd.worker, "w1-plain"))
    await until(flyd.worker, lambda: list(flyd.worker.heartbeat().creating) == ["w1-k"])
    # It has no row yet, but it may soon: asked for it, the worker cannot say no.
    with pytest.raises(Unavailable, match="being created"):
        flyd.worker.answer("w1-k")
    with pytest.raises(NotFound):
        flyd.worker.answer("w1-plain")  # (only creates under a key are vouched for)
    gate.set()
    made, _ = await asyncio.gather(making, unkeyed)
    assert list(flyd.worker.heartbeat().creating) == []
    assert flyd.worker.answer("w1-k").instance_id == made.instance_id


async def test_a_machine_answered_while_it_is_made_is_kept_when_its_maker_gives_up(
    flyd: Flyd, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The create commits, then finishes past its caller's deadline: rolled back, unless
    # somebody was answered with the machine meanwhile (flaps answers a retry with it).
    loop = asyncio.get_running_loop()
    gate, publish = asyncio.Event(), flyd.driver.publish
    answered: list[pb.Machine] = []

    async def held(machine_id: str, ports: Any) -> None:
        if machine_id in flyd.worker.rows and not answered:
            answered.append(flyd.worker.answer(machine_id))
            await gate.wait()
        await publish(machine_id, ports)

    monkeypatch.setattr(flyd.driver, "publish", held)
    deadline = loop.time() + 0.5
    making = asyncio.create_task(
        flyd.worker.create(
            machine_id="w1-k",
            name="",
            app="web",
            config=config(),
            skip_launch=False,
            idempotency_key="k1",
            deadline=deadline,
        )
    )
    await until(flyd.worker, lambda: bool(answered) and loop.time() >= deadline)
    gate.set()
    with pytest.raises(DeadlineExceeded, match="too late"):
        await making
    row = flyd.worker.rows["w1-k"]
    assert (row.state, row.machine.instance_id) == (STARTED, answered[0].instance_id)
    assert "w1-k" not in flyd.worker._rolling_back


async def test_a_key_longer_than_allowed_changes_nothing(flyd: Flyd) -> None:
    seq = flyd.store.last_seq()
    with pytest.raises(InvalidArgument, match="idempotency_key"):
        await create(flyd.worker, "m1", key="k" * (MAX_KEY + 1))
    assert (flyd.store.last_seq(), "m1" in flyd.worker.rows) == (seq, False)


# --- capacity --------------------------------------------------------------------------------

ONE = CapacitySettings(cpu_millicores=1000, memory_mib=1024, machines=1)
TWO_PORTS = range(20000, 20002)
# The second port is taken by something that is not a machine.
TAKEN = {"ports": TWO_PORTS, "busy_ports": {TWO_PORTS[1]}}

EXHAUSTED = [
    # (id, resource, message, config of the new machine, worker settings)
    # m0 (100 millicores, 128 MiB, one service port) runs already.
    ("cpu", "cpu", "900 millicores of cpu free", config(cpu=901), {}),
    ("memory", "memory", "896 MiB of memory free", config(memory=897), {}),
    ("machines", "machines", "0 machines of machines free", config(), {"capacity": ONE}),
    ("ports", "ports", "no free host port", config(services=2), {"ports": TWO_PORTS}),
    ("ports in use", "ports", "no free host port", config(services=1), TAKEN),
]


@pytest.mark.parametrize(
    ("resource", "says", "cfg", "settings"),
    [c[1:] for c in EXHAUSTED],
    ids=[c[0] for c in EXHAUSTED],
)
async def test_resource_exhausted_changes_nothing(
    start_flyd: Boot, resource: str, says: str, cfg: pb.MachineConfig, settings: dict[str, Any]
) -> None:
    flyd = start_flyd(**settings)
    w = flyd.worker
    await create(w, "m0", config(services=1))
    seq, reserved, starts = flyd.store.last_seq(), w.reserved(), len(flyd.driver.starts)
    with pytest.raises(ResourceExhausted, match=says) as caught:
        await create(w, "m1", cfg)
    assert caught.value.resource == resource
    assert caught.value.retryable
    assert ("m1" in w.rows, flyd.store.row("m1")) == (False, None)
    assert (flyd.store.last_seq(), w.reserved()) == (seq, reserved)
    assert (len(flyd.driver.starts), image_refs(w.images)) == (starts, 1)


async def test_capacity_adds_up_exactly(start_flyd: Boot) -> None:
    w = start_flyd().worker
    for i in range(2):
        await create(w, f"m{i}", config(cpu=500, memory=512))
    # Each reserves the default disk (its config says 0): what its filesystem is made at.
    disk = CAPACITY.disk_mib - 2 * DEFAULT_DISK_MIB
    assert w.capacity().free == pb.Resources(disk_mib=disk, machines=8)
    assert dict(w.capacity().machines_by_state) == {"started": 2}


async def test_a_stopped_machine_keeps_its_reservation(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1", config(cpu=600, services=1))
    await w.stop("m1", None, None)
    await w.wait("m1", STOPPED, DEADLINE)
    assert w.reserved().cpu_millicores == 600
    with pytest.raises(ResourceExhausted, match="cpu"):
        await create(w, "m2", config(cpu=600, services=1))


async def test_destroy_releases_reservation_and_ports(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1", config(cpu=600, services=1))
    await w.destroy("m1", force=True)
    await w.wait("m1", DESTROYED, DEADLINE)
    assert w.reserved() == pb.Resources()
    m2 = await create(w, "m2", config(cpu=600, services=1))
    assert [p.host_port for p in m2.ports] == [PORTS[0]]
    assert image_refs(w.images) == 1


async def test_cordon_refuses_creates_while_machines_run_on(
    flyd: Flyd, host: RecordingHost
) -> None:
    w = flyd.worker
    await create(w, "m1")
    assert w.cordon(True) is True
    assert w.capacity().cordoned
    with pytest.raises(Unavailable, match="cordoned"):
        await create(w, "m2")
    assert "m2" not in w.rows
    # The machine already here runs on and still answers to operations.
    assert (w.get("m1").state, host.live_handle("m1")) == (STARTED, w.get("m1").handle)
    await w.stop("m1", None, None)
    await w.wait("m1", STOPPED, DEADLINE)
    await w.start("m1")
    w.cordon(False)
    assert (await create(w, "m2")).state == STARTED


# --- exits and the restart policy -------------------------------------------------------------


async def test_an_exit_reads_its_log_tail_off_the_loop_and_keeps_its_place(flyd: Flyd) -> None:
    # A huge log once made this read block the loop, and a restarted flyd read it again on
    # recovery (issue 27, attack 8): now it waits in a thread, holding only its machine's lock.
    w = flyd.worker
    await create(w, "m1", config(restart=pb.RESTART_MODE_ON_FAILURE, max_retries=2))
    await create(w, "m2")
    flyd.driver.write_log("m1", "last words")
    hold = flyd.driver.host.hold_log_reads()
    flyd.driver.exit("m1", ExitStatus(3, None))
    assert await asyncio.to_thread(hold.waiting.acquire, timeout=DEADLINE)
    # The loop goes on (this test runs on it): another machine's operation is not held up.
    assert (await w.stop("m2", None, None)).state in (STOPPING, STOPPED)
    stop = asyncio.ensure_future(w.stop("m1", None, None))  # asked for after: it comes second
    await asyncio.sleep(0)
    assert w.get("m1").state == STARTED
    assert not stop.done()
    hold.let_go()
    restarting = await w.wait("m1", RESTARTING, DEADLINE)
    assert (restarting.last_exit.has_exit_code, restarting.last_exit.exit_code) == (True, 3)
    assert list(restarting.log_tail) == ["last words"]
    assert (await stop).state == STOPPED  # then the stop, of a machine waiting to restart


async def test_a_crash_loop_ends_failed_with_exit_code_and_log_tail(
    flyd: Flyd, host: RecordingHost, clock: ManualClock
) -> None:
    w = flyd.worker
    cfg = config("fake:run_for=1", "fake:exit_code=3", restart=pb.RESTART_MODE_ON_FAILURE)
    cfg.restart.max_retries = 2
    await create(w, "m1", cfg)
    for attempt, backoff in enumerate([0.5, 1.0]):
        flyd.driver.write_log("m1", f"attempt {attempt}: no config")
        clock.advance(1)  # the process runs out and exits with 3
        restarting = await w.wait("m1", RESTARTING, DEADLINE)
        assert restarting.restart_count == attempt + 1
        clock.advance(backoff)
        await w.wait("m1", STARTED, DEADLINE)
    flyd.driver.write_log("m1", "attempt 2: no config")
    clock.advance(1)
    failed = await w.wait("m1", FAILED, DEADLINE)
    assert (failed.last_exit.has_exit_code, failed.last_exit.exit_code) == (True, 3)
    assert list(failed.log_tail)[-1] == "attempt 2: no config"
    assert host.ran("m1") == 3
    assert w.reserved().machines == 1  # a failed machine keeps its place
    # A user start gives it a fresh budget.
    assert (await w.start("m1")).state == STARTED


@pytest.mark.parametrize(
    ("mode", "code", "state"),
    [
        (pb.RESTART_MODE_NO, 1, STOPPED),
        (pb.RESTART_MODE_ON_FAILURE, 0, STOPPED),
        (pb.RESTART_MODE_ON_FAILURE, 1, RESTARTING),
        (pb.RESTART_MODE_ALWAYS, 0, RESTARTING),
    ],
)
async def test_an_exit_follows_the_restart_policy(
    flyd: Flyd, clock: ManualClock, mode: int, code: int, state: int
) -> None:
    await create(
        flyd.worker, "m1", config("fake:run_for=5", f"fake:exit_code={code}", restart=mode)
    )
    clock.advance(5)
    machine = await flyd.worker.wait("m1", state, DEADLINE)
    assert machine.last_exit.exit_code == code


async def test_a_failing_spawn_gives_up_failed(flyd: Flyd) -> None:
    machine = await create(flyd.worker, "m1", config("fake:start_error=no room"))
    assert machine.state == FAILED
    assert len(flyd.driver.starts) == 3
    assert "no room; gave up after 3 attempts" in machine.events[-1].reason


async def test_signal_and_restart(flyd: Flyd, host: RecordingHost) -> None:
    w = flyd.worker
    await create(w, "m1")
    first = w.get("m1").handle
    assert (await w.signal("m1", signal.SIGUSR1)).state == STARTED
    assert flyd.driver.signals == [("m1", signal.SIGUSR1)]
    await w.restart("m1", None, None)
    await w.wait("m1", STARTED, DEADLINE)
    assert w.get("m1").handle not in (None, first)
    assert host.ran("m1") == 2


async def test_destroy_of_a_running_machine_needs_force(flyd: Flyd) -> None:
    await create(flyd.worker, "m1")
    with pytest.raises(FailedPrecondition, match="force"):
        await flyd.worker.destroy("m1", force=False)
    await flyd.worker.destroy("m1", force=True)
    assert (await flyd.worker.wait("m1", DESTROYED, DEADLINE)).last_exit.signal == "SIGKILL"


# --- waiting -----------------------------------------------------------------------------------


async def test_wait_returns_at_once_when_already_there(flyd: Flyd) -> None:
    await create(flyd.worker, "m1")
    assert (await flyd.worker.wait("m1", STARTED, 0)).id == "m1"


async def test_wait_runs_out_of_time(flyd: Flyd) -> None:
    await create(flyd.worker, "m1")
    with pytest.raises(DeadlineExceeded, match="m1 is started, not stopped"):
        await flyd.worker.wait("m1", STOPPED, 0.01)


async def test_wait_for_a_destroyed_machine_is_a_failed_precondition(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1", skip_launch=True)
    waiter = asyncio.ensure_future(w.wait("m1", STARTED, DEADLINE))
    await w.destroy("m1", force=False)
    with pytest.raises(FailedPrecondition, match="destroyed"):
        await waiter
    with pytest.raises(FailedPrecondition, match="destroyed"):
        await w.wait("m1", STARTED, DEADLINE)
    assert (await w.wait("m1", DESTROYED, 0)).state == DESTROYED


@pytest.mark.parametrize(
    ("machine_id", "state", "error"),
    [
        ("m1", UNSPECIFIED, InvalidArgument),
        ("nope", STARTED, NotFound),
        ("", STARTED, InvalidArgument),
    ],
)
async def test_wait_refuses(
    flyd: Flyd, machine_id: str, state: int, error: type[Exception]
) -> None:
    await create(flyd.worker, "m1", skip_launch=True)
    with pytest.raises(error):
        await flyd.worker.wait(machine_id, state, DEADLINE)


# --- the event stream --------------------------------------------------------------------------


@pytest.fixture
async def streams() -> AsyncIterator[list[Stream]]:
    opened: list[Stream] = []
    yield opened
    for s in opened:
        await s.close()


async def test_watch_from_zero_is_a_snapshot_then_live_changes(
    flyd: Flyd, streams: list[Stream]
) -> None:
    w = flyd.worker
    await create(w, "m1", skip_launch=True)
    streams.append(stream := Stream(w, 0))
    snapshot = (await stream.next()).snapshot
    assert (snapshot.seq, snapshot.reason) == (1, "requested")
    assert [m.id for m in snapshot.machines] == ["m1"]
    heartbeat = (await stream.next()).heartbeat
    assert (heartbeat.seq, heartbeat.worker.id, heartbeat.capacity.free.machines) == (1, "w1", 9)
    await w.start("m1")
    changes = await stream.changes_until(flyd.store.last_seq())
    assert [c.event.seq for c in changes] == [2, 3]
    assert [c.machine.state for c in changes] == [STARTING, STARTED]


async def test_watch_sends_heartbeats_while_nothing_changes(
    flyd: Flyd, streams: list[Stream]
) -> None:
    streams.append(stream := Stream(flyd.worker, 0, heartbeat_interval=0.01))
    assert [await stream.next_kind() for _ in range(4)] == ["snapshot"] + ["heartbeat"] * 3


async def test_watch_from_the_middle_replays(flyd: Flyd, streams: list[Stream]) -> None:
    w = flyd.worker
    await create(w, "m1")  # seq 1..3
    streams.append(stream := Stream(w, 1))
    replayed = await stream.changes_until(3)
    assert [c.event.seq for c in replayed] == [2, 3]
    assert await stream.next_kind() == "heartbeat"
    await w.stop("m1", None, None)
    assert [c.event.seq for c in await stream.changes_until(5)] == [4, 5]


async def test_watch_in_another_log_starts_from_a_snapshot(
    flyd: Flyd, streams: list[Stream]
) -> None:
    """A follower's position counts in a log epoch: one from a wiped worker's old log (even a
    position that exists in this one) gets a snapshot, never this log's changes after it."""
    w = flyd.worker
    await create(w, "m1")  # seq 1..3
    epoch = flyd.store.epoch()
    assert len(epoch) == 16
    streams.append(same := Stream(w, 1, log_epoch=epoch))
    assert [c.event.seq for c in await same.changes_until(3)] == [2, 3]
    streams.append(other := Stream(w, 2, log_epoch="0123456789abcdef"))
    snapshot = (await other.next()).snapshot
    assert (snapshot.reason, snapshot.seq, snapshot.log_epoch) == ("epoch", 3, epoch)
    heartbeat = (await other.next()).heartbeat
    assert heartbeat.log_epoch == epoch
    streams.append(ahead := Stream(w, 99, log_epoch="0123456789abcdef"))
    assert (await ahead.next()).snapshot.reason == "epoch"  # not INVALID_ARGUMENT


async def test_watch_ahead_of_the_log_is_invalid(flyd: Flyd, streams: list[Stream]) -> None:
    streams.append(stream := Stream(flyd.worker, 1))
    with pytest.raises(InvalidArgument, match="from_seq"):
        await stream.next()


async def test_watch_after_compaction_resyncs_from_a_snapshot(
    start_flyd: Boot, streams: list[Stream]
) -> None:
    flyd = start_flyd(log_keep=2)
    w = flyd.worker
    for i in range(6):
        await create(w, f"m{i}", skip_launch=True)
    assert flyd.store.first_seq() > 2
    streams.append(stream := Stream(w, 1))
    snapshot = (await stream.next()).snapshot
    assert (snapshot.reason, snapshot.seq, len(snapshot.machines)) == ("compacted", 6, 6)
    assert await stream.next_kind() == "heartbeat"
    await w.start("m0")
    assert [c.event.seq for c in await stream.changes_until(8)] == [7, 8]


async def test_a_slow_subscriber_catches_up_from_the_log_without_gaps(
    flyd: Flyd, streams: list[Stream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_module, "SUBSCRIBER_QUEUE", 2)
    w = flyd.worker
    streams.append(stream := Stream(w, 0))
    assert [await stream.next_kind() for _ in range(2)] == ["snapshot", "heartbeat"]
    # It reads nothing while eight machines are created and started: its queue overflows.
    for i in range(8):
        await create(w, f"m{i}")
    last = flyd.store.last_seq()
    assert [c.event.seq for c in await stream.changes_until(last)] == list(range(1, last + 1))


async def test_close_ends_every_watch_and_leaves_machines_running(
    flyd: Flyd, host: RecordingHost, streams: list[Stream]
) -> None:
    w = flyd.worker
    streams.append(stream := Stream(w, 0))
    assert [await stream.next_kind() for _ in range(2)] == ["snapshot", "heartbeat"]
    await create(w, "m1")
    await w.close()
    # The stream ends (a follower resumes from the last seq it saw, on the next flyd).
    assert set(await stream.rest()) <= {"change"}
    assert host.live_handle("m1") == w.get("m1").handle
    with pytest.raises(Unavailable, match="shutting down"):
        await create(w, "m2")


async def test_events_list_a_machines_history(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1")
    await create(w, "m2", skip_launch=True)
    await w.stop("m1", None, None)
    await w.wait("m1", STOPPED, DEADLINE)
    events = list(w.events("m1"))
    assert [e.reason for e in events][2].startswith("running (pid ")
    assert history(events) == [
        ("create", "unspecified", "created"),
        ("start", "created", "starting"),
        ("start", "starting", "started"),
        ("stop", "started", "stopping"),
        ("stop", "stopping", "stopped"),
    ]
    assert {e.machine_id for e in events} == {"m1"}
    with pytest.raises(NotFound):
        list(w.events("nope"))


# --- cancellation ------------------------------------------------------------------------------


async def cancel_around_a_change(worker: Worker, task: asyncio.Task[Any], yields: int) -> None:
    """Cancel `task` `yields` loop turns after m1 starts (three changes, published at once)."""
    await asyncio.sleep(0)  # the task gets to its wait
    await worker.start("m1")
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)  # a bound for the failure only
    assert task.cancelled()


@pytest.mark.parametrize("yields", range(4))
async def test_a_cancelled_watch_ends_at_once_even_as_changes_arrive(
    flyd: Flyd, yields: int
) -> None:
    await create(flyd.worker, "m1", skip_launch=True)
    items = flyd.worker.watch(0, heartbeat_interval=3600, stop=asyncio.Event())

    async def read_all() -> None:
        async for _ in items:
            pass

    await cancel_around_a_change(flyd.worker, asyncio.ensure_future(read_all()), yields)


@pytest.mark.parametrize("yields", range(4))
async def test_a_cancelled_wait_ends_at_once_even_as_a_change_arrives(
    flyd: Flyd, yields: int
) -> None:
    await create(flyd.worker, "m1", skip_launch=True)
    waiter = asyncio.ensure_future(flyd.worker.wait("m1", STOPPED, 3600))
    await cancel_around_a_change(flyd.worker, waiter, yields)
