"""flyd.v1.WorkerService in-process (pytest-grpc-aio), on a Worker over the fake driver.

The servicer is wrapped with flyd.service.map_error as flyd.main registers it, so the codes
and ErrorInfo reasons seen here are a caller's. Machines are scripted fakes on a FakeHost;
time (leases, restarts) is a ManualClock the tests advance.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flyd.secrets import SecretBox
from flyd.service import WorkerServicer
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model.errors import DOMAIN
from runtime.clock import ManualClock
from tests.flyd.servicer_support import (  # the servicer fixtures, asked for by name
    Stub,
    create,
    draining,
    flyd,
    grpc_add_to_server,
    grpc_servicer,
    grpc_stub_cls,
    heartbeat_interval,
    log_read_bytes,
    streams_per_caller,
    wait,
)
from tests.flyd.support import (
    CAPACITY,
    CREATED,
    DESTROYED,
    IMAGE,
    STARTED,
    STOPPED,
    Flyd,
    config,
)
from tests.servicers import (
    INVALID,
    NOT_FOUND,
    PRECONDITION,
    T,
    answer,
    bring,
    info_of,
    refused,
    seconds,
    untested,
)

__all__ = [
    "draining",
    "flyd",
    "grpc_add_to_server",
    "grpc_servicer",
    "grpc_stub_cls",
    "heartbeat_interval",
    "log_read_bytes",
    "streams_per_caller",
]

SECRET = "s3cret-" + os.urandom(8).hex()  # a value nothing else could contain by chance


async def machine_in(stub: Stub, state: str) -> str:
    """Machine m1 of app web, brought through the API to `state`: created, or one of
    `bring`'s (started, stopped, destroyed, leased). Its id."""
    await create(stub, skip_launch=state == "created")
    if state != "created":
        await bring(stub, w, "m1", state)
    return "m1"


# -- happy paths --------------------------------------------------------------------------------


async def test_create_runs_the_machine_and_a_repeat_returns_it(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    machine = await create(servicer_stub, name="first")
    assert (machine.id, machine.name, machine.app, machine.state) == ("m1", "first", "web", STARTED)
    assert (machine.worker_id, machine.region, machine.config.image) == ("w1", "ams", IMAGE)
    assert [spec.machine_id for spec in flyd.driver.starts] == ["m1"]
    again = await create(servicer_stub, name="first")
    assert again.instance_id == machine.instance_id  # idempotent by id: nothing new ran
    assert len(flyd.driver.starts) == 1


async def test_a_machine_created_without_an_id_is_named_for_its_worker(
    servicer_stub: Stub,
) -> None:
    # As flaps names the machines it places: any flaps routes a call on it by its id alone.
    machine = await create(servicer_stub, machine_id="", skip_launch=True)
    assert re.fullmatch(r"w1-[0-9a-f]{12}", machine.id), machine.id


async def test_create_without_launch_then_start(servicer_stub: Stub, flyd: Flyd) -> None:
    created = await create(servicer_stub, skip_launch=True)
    assert created.state == CREATED
    assert flyd.driver.starts == []
    started = await servicer_stub.StartMachine(w.StartMachineRequest(machine_id="m1"), timeout=T)
    assert started.machine.state == STARTED
    again = await servicer_stub.StartMachine(w.StartMachineRequest(machine_id="m1"), timeout=T)
    assert again.machine.state == STARTED  # a started machine is returned as it is
    assert len(flyd.driver.starts) == 1


async def test_stop_with_a_signal_then_wait_for_stopped(servicer_stub: Stub, flyd: Flyd) -> None:
    await create(servicer_stub)
    request = w.StopMachineRequest(machine_id="m1", signal="SIGINT", timeout=seconds(5))
    await servicer_stub.StopMachine(request, timeout=T)
    assert (await wait(servicer_stub, STOPPED)).state == STOPPED
    assert flyd.driver.signals == [("m1", signal.SIGINT)]
    again = await servicer_stub.StopMachine(w.StopMachineRequest(machine_id="m1"), timeout=T)
    assert again.machine.state == STOPPED  # a stopped machine is returned as it is


async def test_restart_runs_a_new_process(servicer_stub: Stub, flyd: Flyd) -> None:
    await create(servicer_stub)
    request = w.RestartMachineRequest(machine_id="m1", signal="SIGTERM")
    await servicer_stub.RestartMachine(request, timeout=T)
    await wait(servicer_stub, STARTED)
    assert flyd.driver.signals == [("m1", signal.SIGTERM)]
    assert [spec.machine_id for spec in flyd.driver.starts] == ["m1", "m1"]


@pytest.mark.parametrize(("name", "number"), [("SIGUSR1", signal.SIGUSR1), ("hup", signal.SIGHUP)])
async def test_signal_reaches_the_process(
    servicer_stub: Stub, flyd: Flyd, name: str, number: int
) -> None:
    await create(servicer_stub)
    request = w.SignalMachineRequest(machine_id="m1", signal=name)
    resp = await servicer_stub.SignalMachine(request, timeout=T)
    assert resp.machine.state == STARTED
    assert flyd.driver.signals == [("m1", number)]


async def test_destroy_frees_the_reservation_and_is_idempotent(servicer_stub: Stub) -> None:
    await create(servicer_stub, cfg=config(cpu=300, memory=256))
    request = w.DestroyMachineRequest(machine_id="m1", force=True)
    await servicer_stub.DestroyMachine(request, timeout=T)
    await wait(servicer_stub, DESTROYED)
    again = await servicer_stub.DestroyMachine(request, timeout=T)
    assert again.machine.state == DESTROYED
    got = await servicer_stub.GetMachine(w.GetMachineRequest(machine_id="m1"), timeout=T)
    assert got.machine.state == DESTROYED  # kept, and readable
    capacity = (await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T)).capacity
    assert (capacity.free.cpu_millicores, capacity.free.memory_mib) == (1000, 1024)


@pytest.mark.parametrize(
    ("request_", "listed"),
    [
        (w.ListMachinesRequest(), ["a", "b"]),
        (w.ListMachinesRequest(app="web"), ["a"]),
        (w.ListMachinesRequest(app="nope"), []),
        (w.ListMachinesRequest(state=STOPPED), ["b"]),
        (w.ListMachinesRequest(state=DESTROYED), ["c"]),
        (w.ListMachinesRequest(include_destroyed=True), ["a", "b", "c"]),
    ],
    ids=["all", "app", "unknown-app", "stopped", "destroyed", "include-destroyed"],
)
async def test_list_machines_filters(
    servicer_stub: Stub, request_: w.ListMachinesRequest, listed: list[str]
) -> None:
    await create(servicer_stub, "a")
    await create(servicer_stub, "b", app="api")
    await servicer_stub.StopMachine(w.StopMachineRequest(machine_id="b"), timeout=T)
    await wait(servicer_stub, STOPPED, "b")
    await create(servicer_stub, "c", skip_launch=True)
    await servicer_stub.DestroyMachine(w.DestroyMachineRequest(machine_id="c"), timeout=T)
    await wait(servicer_stub, DESTROYED, "c")
    resp = await servicer_stub.ListMachines(request_, timeout=T)
    assert sorted(m.id for m in resp.machines) == listed


async def test_get_capacity_counts_what_is_reserved(servicer_stub: Stub) -> None:
    before = await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T)
    assert (before.worker.id, before.worker.region) == ("w1", "ams")
    assert before.capacity.total.memory_mib == CAPACITY.memory_mib
    assert before.capacity.free == before.capacity.total
    await create(servicer_stub, cfg=config(cpu=250, memory=512))
    after = (await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T)).capacity
    free = after.free
    assert (free.cpu_millicores, free.memory_mib, free.machines) == (750, 512, 9)
    assert IMAGE in [image.ref for image in after.images]


async def test_watch_events_sends_a_snapshot_then_live_changes(servicer_stub: Stub) -> None:
    await create(servicer_stub, "a")
    call = servicer_stub.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=T)
    try:
        first = await call.read()
        assert isinstance(first, w.WatchEventsResponse)
        assert [m.id for m in first.snapshot.machines] == ["a"]
        assert first.snapshot.reason == "requested"
        beat = await call.read()
        assert isinstance(beat, w.WatchEventsResponse)
        assert beat.heartbeat.seq == first.snapshot.seq  # the first beat comes at once
        await create(servicer_stub, "b", skip_launch=True)
        change = await call.read()
        assert isinstance(change, w.WatchEventsResponse)
        assert (change.change.machine.id, change.change.event.seq) == ("b", beat.heartbeat.seq + 1)
    finally:
        call.cancel()


@pytest.mark.parametrize("heartbeat_interval", [0.05])
async def test_watch_events_ends_when_flyd_drains(
    servicer_stub: Stub, draining: asyncio.Event
) -> None:
    call = servicer_stub.WatchEvents(w.WatchEventsRequest(from_seq=0), timeout=T)
    assert (await call.read()).HasField("snapshot")
    draining.set()  # the stream sees it at its next heartbeat tick, and ends
    while (item := await call.read()) is not grpc.aio.EOF:
        assert item.HasField("heartbeat")
    assert await call.code() == grpc.StatusCode.OK


async def test_machine_logs_tail_then_follow(servicer_stub: Stub, flyd: Flyd) -> None:
    await create(servicer_stub)
    for i in range(5):
        flyd.driver.write_log("m1", f"line {i}")
    request = w.GetMachineLogsRequest(machine_id="m1", tail_lines=2)
    tail = [item.line async for item in servicer_stub.GetMachineLogs(request, timeout=T)]
    assert tail == ["line 3", "line 4"]
    follow = w.GetMachineLogsRequest(machine_id="m1", tail_lines=1, follow=True)
    call = servicer_stub.GetMachineLogs(follow, timeout=T)
    try:
        assert (await call.read()).line == "line 4"
        flyd.driver.write_log("m1", "line 5")  # the machine prints while the client follows
        assert (await call.read()).line == "line 5"
    finally:
        call.cancel()


async def test_a_line_printed_while_the_tail_is_read_is_followed_not_lost(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub)
    flyd.driver.write_log("m1", "before")
    hold = flyd.driver.host.hold_log_reads()
    follow = w.GetMachineLogsRequest(machine_id="m1", follow=True)
    call = servicer_stub.GetMachineLogs(follow, timeout=T)
    try:
        first = asyncio.ensure_future(call.read())
        assert await asyncio.to_thread(hold.waiting.acquire, timeout=T)  # the tail is read
        flyd.driver.write_log("m1", "meanwhile")  # after the read, before the follow starts
        hold.let_go()
        assert (await first).line == "before"
        assert (await call.read()).line == "meanwhile"
    finally:
        call.cancel()


@pytest.mark.parametrize("log_read_bytes", [20])
async def test_a_log_tail_keeps_to_its_byte_cap_and_says_what_it_left_out(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub)
    for i in range(5):
        flyd.driver.write_log("m1", f"line {i}")  # 7 bytes each, with its newline
    request = w.GetMachineLogsRequest(machine_id="m1", tail_lines=5)
    items = [item async for item in servicer_stub.GetMachineLogs(request, timeout=T)]
    assert [(item.line, item.truncated_bytes) for item in items] == [("line 3", 21), ("line 4", 0)]


async def test_a_log_read_in_flight_holds_up_no_other_call(servicer_stub: Stub, flyd: Flyd) -> None:
    await create(servicer_stub)
    flyd.driver.write_log("m1", "hello")
    hold = flyd.driver.host.hold_log_reads()
    call = servicer_stub.GetMachineLogs(w.GetMachineLogsRequest(machine_id="m1"), timeout=T)
    first = asyncio.ensure_future(call.read())
    assert await asyncio.to_thread(hold.waiting.acquire, timeout=T)  # it waits, in its thread
    # Meanwhile the worker answers everything else.
    capacity = await servicer_stub.GetCapacity(w.GetCapacityRequest(), timeout=T)
    assert capacity.worker.id == "w1"
    machine = await servicer_stub.GetMachine(w.GetMachineRequest(machine_id="m1"), timeout=T)
    assert machine.machine.state == STARTED
    assert not first.done()
    hold.let_go()
    assert (await first).line == "hello"


async def held(servicer: WorkerServicer, kind: str, count: int) -> str:
    """Wait until one caller holds `count` calls of `kind`; returns who it is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + T
    while True:
        callers = [c for c, n in servicer.streams.holding(kind).items() if n == count]
        if callers:
            return callers[0]
        assert loop.time() < deadline, f"no caller holds {count} {kind}"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("streams_per_caller", [2])
async def test_a_caller_follows_at_most_its_cap_of_logs(
    servicer_stub: Stub, flyd: Flyd, grpc_servicer: WorkerServicer
) -> None:
    await create(servicer_stub)
    flyd.driver.write_log("m1", "hello")
    follow = w.GetMachineLogsRequest(machine_id="m1", follow=True)
    calls = [servicer_stub.GetMachineLogs(follow, timeout=T) for _ in range(2)]
    try:
        for call in calls:
            assert (await call.read()).line == "hello"  # open, and following
        err = await refused(
            servicer_stub.GetMachineLogs(follow, timeout=T).read(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        info = info_of(err)
        assert (info.reason, info.domain) == ("STREAM_CAP", DOMAIN)
        assert info.metadata["kind"] == "GetMachineLogs follow streams"
        assert info.metadata["limit"] == "2"
        assert "--streams-per-caller 2" in (err.details() or "")
        # A tail alone is no stream: it is not counted.
        tail = w.GetMachineLogsRequest(machine_id="m1")
        assert [item.line async for item in servicer_stub.GetMachineLogs(tail, timeout=T)] == [
            "hello"
        ]
        calls.pop().cancel()  # one ends: another fits
        await held(grpc_servicer, "GetMachineLogs follow streams", 1)
        calls.append(servicer_stub.GetMachineLogs(follow, timeout=T))
        assert (await calls[-1].read()).line == "hello"
        flyd.driver.write_log("m1", "again")
        for call in calls:  # the streams that were let in go on as before
            assert (await call.read()).line == "again"
    finally:
        for call in calls:
            call.cancel()


@pytest.mark.parametrize("streams_per_caller", [2])
async def test_a_caller_waits_at_most_its_cap_at_once(
    servicer_stub: Stub, grpc_servicer: WorkerServicer
) -> None:
    await create(servicer_stub)
    never = w.WaitMachineRequest(machine_id="m1", state=DESTROYED, timeout=seconds(30))
    waits = [asyncio.ensure_future(servicer_stub.WaitMachine(never, timeout=T)) for _ in range(2)]
    try:
        await held(grpc_servicer, "WaitMachine calls", 2)
        err = await refused(
            servicer_stub.WaitMachine(never, timeout=T), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert info_of(err).metadata["kind"] == "WaitMachine calls"
        # The machine is as it was; the waits already in go on, and one ends when it is met.
        destroy = w.DestroyMachineRequest(machine_id="m1", force=True)
        await servicer_stub.DestroyMachine(destroy, timeout=T)
        for done in waits:
            assert (await done).machine.state == DESTROYED
        assert grpc_servicer.streams.open("WaitMachine calls", info_of(err).metadata["caller"]) == 0
    finally:
        for wait_ in waits:
            wait_.cancel()


async def test_a_cordoned_worker_refuses_new_machines_only(servicer_stub: Stub) -> None:
    await create(servicer_stub, "a")
    resp = await servicer_stub.CordonWorker(w.CordonWorkerRequest(cordoned=True), timeout=T)
    assert resp.cordoned
    err = await refused(create(servicer_stub, "b"), grpc.StatusCode.UNAVAILABLE)
    assert err.details() == "worker w1 is cordoned"
    got = await servicer_stub.GetMachine(w.GetMachineRequest(machine_id="a"), timeout=T)
    assert got.machine.state == STARTED  # its machines keep running
    resp = await servicer_stub.CordonWorker(w.CordonWorkerRequest(cordoned=False), timeout=T)
    assert not resp.cordoned
    assert (await create(servicer_stub, "b")).state == STARTED


async def test_update_replaces_the_config_and_the_instance(servicer_stub: Stub) -> None:
    old = await create(servicer_stub)
    request = w.UpdateMachineRequest(machine_id="m1", config=config(memory=512))
    await servicer_stub.UpdateMachine(request, timeout=T)
    new = await wait(servicer_stub, STARTED)
    assert new.config.guest.memory_mib == 512
    assert new.instance_id != old.instance_id


async def test_a_lease_guards_changes_until_released(servicer_stub: Stub) -> None:
    await create(servicer_stub)
    request = w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(60), owner="deploy")
    lease = (await servicer_stub.AcquireLease(request, timeout=T)).lease
    assert lease.nonce
    assert lease.owner == "deploy"
    stop = w.StopMachineRequest(machine_id="m1")
    err = await refused(servicer_stub.StopMachine(stop, timeout=T), PRECONDITION)
    assert (info_of(err).domain, info_of(err).reason) == (DOMAIN, "LEASE_HELD")
    refresh = w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(120), nonce=lease.nonce)
    refreshed = (await servicer_stub.AcquireLease(refresh, timeout=T)).lease
    assert refreshed.nonce == lease.nonce  # a refresh keeps the nonce
    release = w.ReleaseLeaseRequest(machine_id="m1", nonce=lease.nonce)
    await servicer_stub.ReleaseLease(release, timeout=T)
    await servicer_stub.ReleaseLease(release, timeout=T)  # OK when no lease is held
    await servicer_stub.StopMachine(stop, timeout=T)
    assert (await wait(servicer_stub, STOPPED)).state == STOPPED


async def test_a_lease_lapses_when_its_ttl_passes(servicer_stub: Stub, clock: ManualClock) -> None:
    await machine_in(servicer_stub, "leased")
    clock.advance(61)  # the lease was for 60 s
    await servicer_stub.StopMachine(w.StopMachineRequest(machine_id="m1"), timeout=T)
    assert (await wait(servicer_stub, STOPPED)).state == STOPPED


async def test_list_machine_events_tells_the_machines_story(servicer_stub: Stub) -> None:
    await create(servicer_stub)
    await servicer_stub.StopMachine(w.StopMachineRequest(machine_id="m1"), timeout=T)
    await wait(servicer_stub, STOPPED)
    resp = await servicer_stub.ListMachineEvents(w.ListMachineEventsRequest(machine_id="m1"))
    states = [e.to_state for e in resp.events]
    assert states[0] == CREATED
    assert states[-1] == STOPPED
    assert STARTED in states
    assert [e.seq for e in resp.events] == sorted(e.seq for e in resp.events)


def decision() -> pb.PlacementDecision:
    """A placement decision as flaps hands it over with a create."""
    made = pb.PlacementDecision(worker_id="w1", sample_size=8)
    made.decided_at.FromSeconds(1_700_000_000)
    region = made.regions.add(region="ams", outcome="placed", examined=2)
    region.candidates.add(worker_id="w1", score=0.75, sub_scores={"cpu": 0.5, "memory": 1.0})
    region.rejections_by_reason["cordoned"] = 1
    return made


async def test_get_placement_returns_the_decision_kept_with_the_machine(
    servicer_stub: Stub,
) -> None:
    await create(servicer_stub, "a", placement=decision())
    await create(servicer_stub, "b")  # straight on the worker: no decision
    got = await servicer_stub.GetPlacement(w.GetPlacementRequest(machine_id="a"), timeout=T)
    assert got.placement == decision()
    none = await servicer_stub.GetPlacement(w.GetPlacementRequest(machine_id="b"), timeout=T)
    assert not none.HasField("placement")
    await servicer_stub.DestroyMachine(w.DestroyMachineRequest(machine_id="a", force=True))
    await wait(servicer_stub, DESTROYED, "a")
    gone = await servicer_stub.GetPlacement(w.GetPlacementRequest(machine_id="a"), timeout=T)
    assert not gone.HasField("placement")  # a destroyed machine keeps none


async def test_supersede_stops_an_outranked_primary_which_then_stands_by(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub)  # the primary of its own slot, at generation 0
    request = w.SupersedeMachineRequest(
        machine_id="m1", generation=1, primary="m2", primary_app="web"
    )
    told = (await servicer_stub.SupersedeMachine(request, timeout=T)).machine
    assert (told.slot.id, told.slot.generation, told.slot.primary) == ("m1", 1, "m2")
    assert (await wait(servicer_stub, STOPPED)).slot.primary == "m2"
    assert flyd.driver.signals == [("m1", signal.SIGTERM)]
    # A standby now: a plain start is refused, with why.
    start = w.StartMachineRequest(machine_id="m1")
    err = await refused(servicer_stub.StartMachine(start, timeout=T), PRECONDITION)
    assert (info_of(err).domain, info_of(err).reason) == (DOMAIN, "STANDBY")


@pytest.mark.parametrize(
    ("state", "generation", "primary"),
    [
        ("promoted", 1, "a"),  # a stale generation: the slot is at 2
        ("promoted", 2, "m9"),  # the same generation, a higher id: m1 keeps it
        ("started", 5, "m1"),  # the machine's own id
        ("destroyed", 1, "m2"),  # a destroyed machine has no claim to give up
    ],
    ids=["stale-generation", "same-generation-higher-id", "itself", "destroyed"],
)
async def test_supersede_with_a_claim_that_does_not_outrank_changes_nothing(
    servicer_stub: Stub, flyd: Flyd, state: str, generation: int, primary: str
) -> None:
    """The worker answers OK with the machine as it is (a claim is a fact about the slot, not
    a request that can fail): no FAILED_PRECONDITION, nothing written."""
    if state == "promoted":
        await create(servicer_stub)
        promote = w.StartMachineRequest(machine_id="m1", generation=2)
        assert (await servicer_stub.StartMachine(promote, timeout=T)).machine.slot.generation == 2
    else:
        await machine_in(servicer_stub, state)
    before, seq = flyd.worker.rows["m1"].machine, flyd.store.last_seq()
    signals = list(flyd.driver.signals)
    request = w.SupersedeMachineRequest(
        machine_id="m1", generation=generation, primary=primary, primary_app="web"
    )
    resp = await servicer_stub.SupersedeMachine(request, timeout=T)
    assert resp.machine == before
    assert (flyd.worker.rows["m1"].machine, flyd.store.last_seq()) == (before, seq)
    assert flyd.driver.signals == signals  # nothing was stopped


async def test_reveal_secrets_opens_them_while_the_machine_lives(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    cfg = config()
    cfg.secrets.update({"TOKEN": SECRET, "OTHER": "two"})
    await create(servicer_stub, cfg=cfg)
    got = await servicer_stub.GetMachine(w.GetMachineRequest(machine_id="m1"), timeout=T)
    assert SECRET not in str(got.machine)  # only names where anyone reads the machine
    request = w.RevealSecretsRequest(machine_id="m1")
    opened = await servicer_stub.RevealSecrets(request, timeout=T)
    assert dict(opened.secrets) == {"TOKEN": SECRET, "OTHER": "two"}
    await bring(servicer_stub, w, "m1", "destroyed")
    assert dict((await servicer_stub.RevealSecrets(request, timeout=T)).secrets) == {}


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rpc", "request_", "field"),
    [
        ("CreateMachine", w.CreateMachineRequest(machine_id="M1", app="web"), "machine_id"),
        ("CreateMachine", w.CreateMachineRequest(machine_id="m2", app=""), "app"),
        ("CreateMachine", w.CreateMachineRequest(machine_id="m2", app="Web"), "app"),
        ("CreateMachine", w.CreateMachineRequest(app="web", name="n" * 64), "name"),
        ("CreateMachine", w.CreateMachineRequest(app="web"), "config.image"),
        (
            "CreateMachine",
            w.CreateMachineRequest(app="web", config=pb.MachineConfig(image="app:v1:x")),
            "config.image",
        ),
        (
            "CreateMachine",
            w.CreateMachineRequest(app="web", config=config(cpu=0)),
            "config.guest.cpu_millicores",
        ),
        (
            "CreateMachine",
            w.CreateMachineRequest(app="web", config=config(memory=-1)),
            "config.guest.memory_mib",
        ),
        ("StartMachine", w.StartMachineRequest(), "machine_id"),
        ("StopMachine", w.StopMachineRequest(machine_id="m1", signal="SIGNOPE"), "signal"),
        ("StopMachine", w.StopMachineRequest(machine_id="m1", timeout=seconds(301)), "timeout"),
        (
            "StopMachine",
            w.StopMachineRequest(machine_id="m1", timeout=Duration(seconds=-1)),
            "timeout",
        ),
        ("RestartMachine", w.RestartMachineRequest(machine_id="m1", signal="nope"), "signal"),
        ("SignalMachine", w.SignalMachineRequest(machine_id="m1"), "signal"),
        ("SignalMachine", w.SignalMachineRequest(machine_id="m1", signal="SIGWHAT"), "signal"),
        ("DestroyMachine", w.DestroyMachineRequest(), "machine_id"),
        ("GetMachine", w.GetMachineRequest(), "machine_id"),
        ("ListMachines", w.ListMachinesRequest(app="Web"), "app"),
        (
            "WaitMachine",
            w.WaitMachineRequest(machine_id="m1", state=STOPPED, timeout=seconds(61)),
            "timeout",
        ),
        ("WaitMachine", w.WaitMachineRequest(machine_id="m1"), "state"),
        ("WatchEvents", w.WatchEventsRequest(from_seq=10_000), "from_seq"),
        ("GetMachineLogs", w.GetMachineLogsRequest(machine_id="m1", tail_lines=-1), "tail_lines"),
        (
            "GetMachineLogs",
            w.GetMachineLogsRequest(machine_id="m1", tail_lines=10_001),
            "tail_lines",
        ),
        (
            "UpdateMachine",
            w.UpdateMachineRequest(machine_id="m1", config=config(memory=0)),
            "config.guest.memory_mib",
        ),
        ("AcquireLease", w.AcquireLeaseRequest(machine_id="m1"), "ttl"),
        ("AcquireLease", w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(0.5)), "ttl"),
        ("AcquireLease", w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(3601)), "ttl"),
        (
            "SupersedeMachine",
            w.SupersedeMachineRequest(machine_id="m1", generation=0, primary="m2"),
            "generation",
        ),
        (
            "SupersedeMachine",
            w.SupersedeMachineRequest(machine_id="m1", generation=1, primary="Not An Id"),
            "primary",
        ),
        (
            "SupersedeMachine",
            w.SupersedeMachineRequest(machine_id="m1", generation=1, primary="m2"),
            "primary_app",
        ),
        ("RevealSecrets", w.RevealSecretsRequest(), "machine_id"),
        ("GetPlacement", w.GetPlacementRequest(), "machine_id"),
    ],
)
async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    servicer_stub: Stub, flyd: Flyd, rpc: str, request_: Any, field: str
) -> None:
    await create(servicer_stub)
    seq = flyd.store.last_seq()
    await refused(answer(servicer_stub, rpc, request_), INVALID, field)
    assert flyd.store.last_seq() == seq
    assert list(flyd.worker.rows) == ["m1"]


@pytest.mark.parametrize(
    ("rpc", "request_"),
    [
        ("StartMachine", w.StartMachineRequest(machine_id="ghost")),
        ("StopMachine", w.StopMachineRequest(machine_id="ghost")),
        ("RestartMachine", w.RestartMachineRequest(machine_id="ghost")),
        ("SignalMachine", w.SignalMachineRequest(machine_id="ghost", signal="SIGUSR1")),
        ("DestroyMachine", w.DestroyMachineRequest(machine_id="ghost", force=True)),
        ("GetMachine", w.GetMachineRequest(machine_id="ghost")),
        ("WaitMachine", w.WaitMachineRequest(machine_id="ghost", state=STARTED)),
        ("GetMachineLogs", w.GetMachineLogsRequest(machine_id="ghost")),
        ("UpdateMachine", w.UpdateMachineRequest(machine_id="ghost", config=config())),
        ("AcquireLease", w.AcquireLeaseRequest(machine_id="ghost", ttl=seconds(10))),
        ("ReleaseLease", w.ReleaseLeaseRequest(machine_id="ghost", nonce="x")),
        ("ListMachineEvents", w.ListMachineEventsRequest(machine_id="ghost")),
        ("GetPlacement", w.GetPlacementRequest(machine_id="ghost")),
        (
            "SupersedeMachine",
            w.SupersedeMachineRequest(
                machine_id="ghost", generation=1, primary="m2", primary_app="web"
            ),
        ),
        ("RevealSecrets", w.RevealSecretsRequest(machine_id="ghost")),
    ],
)
async def test_an_unknown_machine_is_not_found(
    servicer_stub: Stub, flyd: Flyd, rpc: str, request_: Any
) -> None:
    err = await refused(answer(servicer_stub, rpc, request_), NOT_FOUND)
    assert err.details() == "machine ghost not found on worker w1"
    assert flyd.store.last_seq() == 0


async def test_an_unknown_image_is_not_found(servicer_stub: Stub, flyd: Flyd) -> None:
    cfg = config()
    cfg.image = "nope:v1"
    err = await refused(create(servicer_stub, cfg=cfg), NOT_FOUND)
    assert "nope" in (err.details() or "")
    assert flyd.worker.rows == {}


@pytest.mark.parametrize(
    ("state", "rpc", "request_", "reason"),
    [
        ("created", "RestartMachine", w.RestartMachineRequest(machine_id="m1"), "WRONG_STATE"),
        ("stopped", "RestartMachine", w.RestartMachineRequest(machine_id="m1"), "WRONG_STATE"),
        (
            "stopped",
            "SignalMachine",
            w.SignalMachineRequest(machine_id="m1", signal="SIGUSR1"),
            "WRONG_STATE",
        ),
        ("started", "DestroyMachine", w.DestroyMachineRequest(machine_id="m1"), "WRONG_STATE"),
        ("destroyed", "StartMachine", w.StartMachineRequest(machine_id="m1"), "MACHINE_DESTROYED"),
        ("destroyed", "StopMachine", w.StopMachineRequest(machine_id="m1"), "MACHINE_DESTROYED"),
        (
            "destroyed",
            "UpdateMachine",
            w.UpdateMachineRequest(machine_id="m1", config=config()),
            "MACHINE_DESTROYED",
        ),
        (
            "destroyed",
            "WaitMachine",
            w.WaitMachineRequest(machine_id="m1", state=STARTED),
            "MACHINE_DESTROYED",
        ),
        (
            "destroyed",
            "AcquireLease",
            w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(10)),
            "MACHINE_DESTROYED",
        ),
        ("leased", "StopMachine", w.StopMachineRequest(machine_id="m1"), "LEASE_HELD"),
        (
            "leased",
            "DestroyMachine",
            w.DestroyMachineRequest(machine_id="m1", force=True),
            "LEASE_HELD",
        ),
        (
            "leased",
            "AcquireLease",
            w.AcquireLeaseRequest(machine_id="m1", ttl=seconds(10)),
            "LEASE_HELD",
        ),
        (
            "leased",
            "ReleaseLease",
            w.ReleaseLeaseRequest(machine_id="m1", nonce="not-it"),
            "LEASE_HELD",
        ),
    ],
)
async def test_an_operation_the_state_forbids_fails_its_precondition_with_a_reason(
    servicer_stub: Stub, flyd: Flyd, state: str, rpc: str, request_: Any, reason: str
) -> None:
    await machine_in(servicer_stub, state)
    before = flyd.worker.rows["m1"].machine
    err = await refused(answer(servicer_stub, rpc, request_), PRECONDITION)
    info = info_of(err)
    assert (info.domain, info.reason) == (DOMAIN, reason), err.details()
    assert flyd.worker.rows["m1"].machine == before  # nothing changed


async def test_secrets_the_workers_key_no_longer_opens_are_not_revealed(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    cfg = config()
    cfg.secrets["TOKEN"] = SECRET
    await create(servicer_stub, cfg=cfg)
    flyd.worker.secret_box = SecretBox.ephemeral()  # its key file replaced, as after a restart
    request = w.RevealSecretsRequest(machine_id="m1")
    err = await refused(servicer_stub.RevealSecrets(request, timeout=T), PRECONDITION)
    assert err.details() == "secret TOKEN of machine m1 does not open with this worker's key"


@pytest.mark.parametrize(
    ("cfg", "resource"),
    [
        (config(cpu=1001), "cpu"),
        (config(memory=1025), "memory"),
        (config(services=11), "ports"),
    ],
)
async def test_a_machine_without_room_is_refused_naming_the_resource(
    servicer_stub: Stub, flyd: Flyd, cfg: pb.MachineConfig, resource: str
) -> None:
    err = await refused(create(servicer_stub, cfg=cfg), grpc.StatusCode.RESOURCE_EXHAUSTED)
    info = info_of(err)
    assert (info.domain, info.reason, dict(info.metadata)) == (
        DOMAIN,
        "NO_ROOM",
        {"resource": resource},
    )
    assert flyd.worker.rows == {}


async def test_the_same_id_with_another_config_already_exists(
    servicer_stub: Stub, flyd: Flyd
) -> None:
    await create(servicer_stub)
    err = await refused(
        create(servicer_stub, cfg=config(memory=256)), grpc.StatusCode.ALREADY_EXISTS
    )
    assert "m1" in (err.details() or "")
    assert flyd.worker.rows["m1"].machine.config.guest.memory_mib == 128


def test_every_rpc_of_the_service_is_called_here() -> None:
    service = w.DESCRIPTOR.services_by_name["WorkerService"]
    assert untested(service, sys.modules[__name__]) == []
