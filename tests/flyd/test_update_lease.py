"""UpdateMachine and leases: a Worker on a FakeDriver over both log backends, then a real flyd.

Time is a ManualClock: a lease expires when a test advances it. Nothing sleeps for timing.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from flyd.drivers.base import ProcessSpec, port_env
from flyd.fakes import FakeDriver
from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as wpb
from flyd.v1 import worker_pb2_grpc
from flyd.worker import Worker
from model.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from model.images.owners import PUBLIC
from model.validate import DEFAULT_DISK_MIB
from runtime.clock import ManualClock
from tests.flyd.support import (
    CAPACITY,
    DEADLINE,
    PORTS,
    Boot,
    Flyd,
    Node,
    RecordingHost,
    Stream,
    config,
    create,
    history,
    image_refs,
    log_changes,
)
from tests.harness import ServiceProcess, error_info

S = pb.MachineState
CREATED = S.MACHINE_STATE_CREATED
STARTED = S.MACHINE_STATE_STARTED
STOPPING = S.MACHINE_STATE_STOPPING
STOPPED = S.MACHINE_STATE_STOPPED
DESTROYED = S.MACHINE_STATE_DESTROYED


def updated(cfg: pb.MachineConfig, **env: str) -> pb.MachineConfig:
    """`cfg` with another command and these environment variables."""
    new = pb.MachineConfig()
    new.CopyFrom(cfg)
    new.cmd[:] = ["serve", "--v2"]
    new.env.update(env)
    return new


def starts_of(flyd: Flyd, machine_id: str) -> list[ProcessSpec]:
    return [spec for spec in flyd.driver.starts if spec.machine_id == machine_id]


# --- update ------------------------------------------------------------------------------------


async def test_update_a_started_machine_runs_the_new_config(
    flyd: Flyd, host: RecordingHost
) -> None:
    w = flyd.worker
    old_cfg = config(services=1)
    old_cfg.stop.signal = "SIGINT"  # the old process is stopped the old config's way
    before = await create(w, "m1", old_cfg)
    new_cfg = updated(config(services=1), GREETING="hello")

    during = await w.update("m1", new_cfg, skip_launch=False)
    # The response already shows the new config and instance; the old process is stopping.
    assert (during.state, during.config, during.id) == (STOPPING, new_cfg, "m1")
    assert during.instance_id != before.instance_id
    after = await w.wait("m1", STARTED, DEADLINE, instance_id=during.instance_id)

    assert after.config == new_cfg
    assert [(p.internal_port, p.host_port) for p in after.ports] == [(8080, PORTS[0])]
    assert after.last_exit.signal == "SIGINT"
    assert ("m1", signal.SIGINT) in flyd.driver.signals
    old_spec, new_spec = starts_of(flyd, "m1")
    assert (old_spec.argv, new_spec.argv) == (["app"], ["app", "serve", "--v2"])
    assert "GREETING" not in old_spec.env
    assert new_spec.env["GREETING"] == "hello"
    assert new_spec.env["INSTANCE_ID"] == after.instance_id != old_spec.env["INSTANCE_ID"]
    assert port_env(new_spec.ports, inside=False)["PORT"] == str(PORTS[0])
    assert host.ran("m1") == 2
    assert host.live_handle("m1") == w.get("m1").handle
    assert history(w.events("m1"))[-3:] == [
        ("update", "started", "stopping"),
        ("update", "stopping", "starting"),
        ("update", "starting", "started"),
    ]
    assert image_refs(w.images) == 1
    log_changes(flyd.store)


UPDATE_STATES = [
    # (id, how m1 is created and left, skip_launch, the state the update ends in, new starts)
    ("started, skip launch", "started", True, STOPPED, 0),
    ("stopped", "stopped", False, STARTED, 1),
    ("stopped, skip launch", "stopped", True, STOPPED, 0),
    ("created, skip launch", "created", True, CREATED, 0),
    ("created", "created", False, STARTED, 1),
]


@pytest.mark.parametrize(
    ("before", "skip_launch", "state", "new_starts"),
    [c[1:] for c in UPDATE_STATES],
    ids=[c[0] for c in UPDATE_STATES],
)
async def test_update_launches_unless_skip_launch(
    flyd: Flyd, before: str, skip_launch: bool, state: int, new_starts: int
) -> None:
    w = flyd.worker
    await create(w, "m1", skip_launch=before == "created")
    if before == "stopped":
        await w.stop("m1", None, None)
        await w.wait("m1", STOPPED, DEADLINE)
    starts = len(flyd.driver.starts)
    new_cfg = updated(config(), GREETING="hi")
    machine = await w.update("m1", new_cfg, skip_launch=skip_launch)
    machine = await w.wait("m1", state, DEADLINE, instance_id=machine.instance_id)
    assert machine.config == new_cfg
    assert w.get("m1").op is None
    assert len(flyd.driver.starts) == starts + new_starts
    if new_starts:
        assert flyd.driver.starts[-1].env["GREETING"] == "hi"
    # A machine left stopped starts later with the new config.
    if state != STARTED:
        await w.start("m1")
        assert flyd.driver.starts[-1].env["INSTANCE_ID"] == machine.instance_id


UPDATE_EXHAUSTED = [
    # (id, m1's new config, resource, message): m0 (100 millicores, 128 MiB, one of the three
    # host ports) and m1 (the same, no port) run on 1000 millicores and 1024 MiB
    ("memory", config(memory=1024 - 128 + 1), "memory", "896 MiB of memory free"),
    ("cpu", config(cpu=1000 - 100 + 1), "cpu", "900 millicores of cpu free"),
    ("ports", config(services=3), "ports", "no free host port"),
]


@pytest.mark.parametrize(
    ("cfg", "resource", "says"),
    [c[1:] for c in UPDATE_EXHAUSTED],
    ids=[c[0] for c in UPDATE_EXHAUSTED],
)
async def test_update_that_does_not_fit_changes_nothing(
    start_flyd: Boot, cfg: pb.MachineConfig, resource: str, says: str
) -> None:
    w = start_flyd(ports=range(20000, 20003)).worker
    flyd_store = w.store
    await create(w, "m0", config(services=1))
    before = await create(w, "m1")
    seq, reserved, row = flyd_store.last_seq(), w.reserved(), w.get("m1")
    with pytest.raises(ResourceExhausted, match=says) as caught:
        await w.update("m1", cfg, skip_launch=False)
    assert caught.value.resource == resource
    assert w.get("m1") is row
    assert w.get("m1").machine.instance_id == before.instance_id
    assert (flyd_store.last_seq(), w.reserved(), image_refs(w.images)) == (seq, reserved, 2)


async def test_update_may_grow_into_its_own_reservation(flyd: Flyd) -> None:
    """The machine's old size is not counted against its new one: exactly full is fine."""
    w = flyd.worker
    await create(w, "m0")
    await create(w, "m1")
    machine = await w.update("m1", config(memory=1024 - 128, cpu=900), skip_launch=False)
    await w.wait("m1", STARTED, DEADLINE, instance_id=machine.instance_id)
    assert w.capacity().free == pb.Resources(
        disk_mib=CAPACITY.disk_mib - 2 * DEFAULT_DISK_MIB, machines=8
    )


def with_disk(disk_mib: int) -> pb.MachineConfig:
    cfg = config()
    cfg.guest.disk_mib = disk_mib
    return cfg


@pytest.mark.parametrize(
    ("created", "asked", "refused"),
    [
        (64, 128, False),  # grows: its disk file is grown at its next start
        (64, 64, False),
        (64, 32, True),
        (512, 0, True),  # 0 is the default, 256: smaller too
        (0, DEFAULT_DISK_MIB, False),  # the same size, said outright
    ],
)
async def test_update_grows_a_disk_and_never_shrinks_one(
    flyd: Flyd, created: int, asked: int, refused: bool
) -> None:
    """What a machine wrote stays: an update to a smaller disk is refused, naming the field,
    and changes nothing; a larger one reserves the difference."""
    w = flyd.worker
    before = await create(w, "m1", with_disk(created))
    seq, reserved = w.store.last_seq(), w.reserved()
    if refused:
        with pytest.raises(InvalidArgument, match="cannot shrink") as caught:
            await w.update("m1", with_disk(asked), skip_launch=False)
        assert caught.value.field == "config.guest.disk_mib"
        assert (w.store.last_seq(), w.reserved()) == (seq, reserved)
        assert w.get("m1").machine.instance_id == before.instance_id
        return
    machine = await w.update("m1", with_disk(asked), skip_launch=False)
    await w.wait("m1", STARTED, DEADLINE, instance_id=machine.instance_id)
    grown = (asked or DEFAULT_DISK_MIB) - (created or DEFAULT_DISK_MIB)
    assert w.reserved().disk_mib == reserved.disk_mib + grown
    assert flyd.driver.starts[-1].limits.disk_mib == (asked or DEFAULT_DISK_MIB)


async def test_update_keeps_remaps_and_frees_ports(flyd: Flyd) -> None:
    w = flyd.worker
    cfg = config(services=2)  # 8080 and 8081
    first = await create(w, "m1", cfg)
    assert [(p.internal_port, p.host_port) for p in first.ports] == [
        (8080, PORTS[0]),
        (8081, PORTS[1]),
    ]
    new_cfg = config()
    new_cfg.services.add(internal_port=8081)  # kept
    new_cfg.services.add(internal_port=9000)  # new; 8080 goes
    machine = await w.update("m1", new_cfg, skip_launch=False)
    assert [(p.internal_port, p.host_port) for p in machine.ports] == [
        (8081, PORTS[1]),
        (9000, PORTS[2]),
    ]
    await w.wait("m1", STARTED, DEADLINE, instance_id=machine.instance_id)
    env = port_env(flyd.driver.starts[-1].ports, inside=False)  # the process driver's
    assert (env["PORT"], env["PORT_8081"], env["PORT_9000"]) == tuple(
        str(p) for p in (PORTS[1], PORTS[1], PORTS[2])
    )
    assert "PORT_8080" not in env
    # The port 8080 had is free again.
    m2 = await create(w, "m2", config(services=1))
    assert [p.host_port for p in m2.ports] == [PORTS[0]]


@pytest.fixture
def app_v2(tmp_path: Path, images: ImageCache) -> str:
    """A second image, `app:v2`, in the test's image source; returns its digest."""
    src = tmp_path / "app-v2-src"
    src.mkdir()
    (src / "app2").write_text("#!/bin/sh\n")
    return build_image(
        src, tmp_path / "source", name="app", tag="v2", entrypoint=["app2"], owners=PUBLIC
    )


def refs(images: ImageCache) -> dict[str, int]:
    return {img.ref: img.refs for img in images.cached()}


async def test_update_to_another_image_moves_the_reference(flyd: Flyd, app_v2: str) -> None:
    w = flyd.worker
    await create(w, "m1")
    assert refs(w.images) == {"app:v1": 1}
    machine = await w.update(
        "m1", pb.MachineConfig(image="app:v2", guest=config().guest), skip_launch=False
    )
    await w.wait("m1", STARTED, DEADLINE, instance_id=machine.instance_id)
    assert w.get("m1").image_digest == app_v2
    assert refs(w.images) == {"app:v1": 0, "app:v2": 1}
    assert flyd.driver.starts[-1].argv == ["app2"]
    # Back to the first image, and away: every reference taken is given back.
    machine = await w.update("m1", config(), skip_launch=True)
    assert refs(w.images) == {"app:v1": 1, "app:v2": 0}
    await w.destroy("m1", force=True)
    await w.wait("m1", DESTROYED, DEADLINE)
    assert refs(w.images) == {"app:v1": 0, "app:v2": 0}


async def test_a_refused_update_changes_nothing_and_takes_no_image_reference(
    flyd: Flyd, app_v2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = flyd.worker
    v2 = pb.MachineConfig(image="app:v2", guest=config().guest)
    await create(w, "m1")
    await create(w, "m2", skip_launch=True)
    await w.destroy("m2", force=False)

    async def stuck_stop(machine_id: str, sig: int, timeout: float) -> object:
        await asyncio.Event().wait()  # the old process takes its time to stop
        raise AssertionError("unreachable")

    monkeypatch.setattr(flyd.driver, "stop", stuck_stop)
    await w.update("m1", config(), skip_launch=False)  # stuck stopping the old process
    row, seq = w.get("m1"), flyd.store.last_seq()
    for machine_id, says, reason in [
        ("m1", r"busy \(update\)", "MACHINE_BUSY"),
        ("m2", "destroyed", "MACHINE_DESTROYED"),
    ]:
        with pytest.raises(FailedPrecondition, match=says) as refused:
            await w.update(machine_id, v2, skip_launch=False)
        assert refused.value.reason == reason
    assert (w.get("m1"), flyd.store.last_seq()) == (row, seq)
    assert refs(w.images).get("app:v2", 0) == 0
    assert refs(w.images)["app:v1"] == 1


async def test_an_update_cancelled_while_spawning_changes_nothing(
    flyd: Flyd, app_v2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller goes away while the new process is being spawned. The spawn comes before the
    update's first commit (it is committed with the spawned process), so nothing was committed:
    the machine keeps its old config and image, and only the old image stays referenced."""
    w = flyd.worker
    before = await create(w, "m1", skip_launch=True)
    seq = flyd.store.last_seq()
    spawning, never = asyncio.Event(), asyncio.Event()

    async def slow_start(spec: ProcessSpec) -> object:
        spawning.set()
        await never.wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(flyd.driver, "start", slow_start)
    task = asyncio.ensure_future(
        w.update("m1", pb.MachineConfig(image="app:v2", guest=config().guest), skip_launch=False)
    )
    async with asyncio.timeout(DEADLINE):
        await spawning.wait()
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    assert (w.get("m1").machine, flyd.store.last_seq()) == (before, seq)
    assert w.get("m1").image_digest != app_v2
    assert refs(w.images) == {"app:v1": 1, "app:v2": 0}


# --- leases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guarded:
    """An operation a lease guards: how m1 must be before it, and how to tell it happened."""

    before: str  # "started" or "created"
    act: Callable[[Worker, str], Awaitable[object]]
    done: Callable[[Worker], Awaitable[object]]


async def _settle(w: Worker, state: int) -> pb.Machine:
    return await w.wait("m1", state, DEADLINE)


async def _signalled(w: Worker) -> None:
    assert isinstance(w.driver, FakeDriver)
    assert w.driver.signals == [("m1", signal.SIGUSR1)]


async def _updated(w: Worker) -> pb.Machine:
    machine = await _settle(w, STARTED)
    assert machine.config.env["GREETING"] == "leased"
    return machine


GUARDED = {
    "start": Guarded(
        "created", lambda w, n: w.start("m1", lease_nonce=n), lambda w: _settle(w, STARTED)
    ),
    "stop": Guarded(
        "started",
        lambda w, n: w.stop("m1", None, None, lease_nonce=n),
        lambda w: _settle(w, STOPPED),
    ),
    "restart": Guarded(
        "started",
        lambda w, n: w.restart("m1", None, None, lease_nonce=n),
        lambda w: _settle(w, STARTED),
    ),
    "signal": Guarded(
        "started",
        lambda w, n: w.signal("m1", signal.SIGUSR1, lease_nonce=n),
        _signalled,
    ),
    "destroy": Guarded(
        "started",
        lambda w, n: w.destroy("m1", force=True, lease_nonce=n),
        lambda w: _settle(w, DESTROYED),
    ),
    "update": Guarded(
        "started",
        lambda w, n: w.update(
            "m1", updated(config(), GREETING="leased"), skip_launch=False, lease_nonce=n
        ),
        _updated,
    ),
}


async def leased(w: Worker, g: Guarded) -> str:
    """m1 as `g` needs it, leased for 60s; returns the nonce."""
    await create(w, "m1", skip_launch=g.before == "created")
    lease = await w.acquire_lease("m1", ttl=60, owner="deployer", description="", nonce="")
    assert len(lease.nonce) == 32
    return lease.nonce


@pytest.mark.parametrize("name", GUARDED)
async def test_a_lease_refuses_changes_without_its_nonce(flyd: Flyd, name: str) -> None:
    g, w = GUARDED[name], flyd.worker
    nonce = await leased(w, g)
    row, seq, starts = w.get("m1"), flyd.store.last_seq(), len(flyd.driver.starts)
    for wrong in ["", "0" * 32]:
        with pytest.raises(FailedPrecondition, match="leased by deployer for 60s more") as err:
            await g.act(w, wrong)
        assert err.value.reason == "LEASE_HELD"
    assert w.get("m1") is row
    assert (flyd.store.last_seq(), len(flyd.driver.starts), flyd.driver.signals) == (
        seq,
        starts,
        [],
    )
    assert image_refs(w.images) == 1
    # The holder can.
    await g.act(w, nonce)
    await g.done(w)


@pytest.mark.parametrize("name", GUARDED)
async def test_after_the_lease_expires_anyone_can(
    flyd: Flyd, clock: ManualClock, name: str
) -> None:
    g, w = GUARDED[name], flyd.worker
    await leased(w, g)
    clock.advance(59)
    with pytest.raises(FailedPrecondition, match="leased by deployer for 1s more"):
        await g.act(w, "")
    clock.advance(1)
    await g.act(w, "")
    await g.done(w)


async def test_acquire_refresh_and_release(flyd: Flyd, clock: ManualClock) -> None:
    w = flyd.worker
    await create(w, "m1")
    lease = await w.acquire_lease("m1", ttl=60, owner="deployer", description="v2", nonce="")
    assert (lease.owner, lease.description) == ("deployer", "v2")
    assert lease.expires_at.ToSeconds() == int(clock.now()) + 60
    shown = w.get("m1").machine.lease
    assert (shown.owner, shown.expires_at, shown.nonce) == ("deployer", lease.expires_at, "")

    # Somebody else is refused, even to refresh; the holder refreshes and keeps the nonce.
    with pytest.raises(FailedPrecondition, match="leased by deployer"):
        await w.acquire_lease("m1", ttl=60, owner="other", description="", nonce="")
    clock.advance(30)
    again = await w.acquire_lease(
        "m1", ttl=600, owner="deployer", description="", nonce=lease.nonce
    )
    assert again.nonce == lease.nonce
    assert again.expires_at.ToSeconds() == int(clock.now()) + 600

    with pytest.raises(FailedPrecondition, match="not the nonce"):
        await w.release_lease("m1", "")
    await w.release_lease("m1", lease.nonce)
    assert not w.get("m1").machine.HasField("lease")
    await w.release_lease("m1", "")  # nothing held: fine
    await w.stop("m1", None, None)  # no lease, no nonce needed
    with pytest.raises(NotFound):
        await w.acquire_lease("nope", ttl=60, owner="", description="", nonce="")
    with pytest.raises(NotFound):
        await w.release_lease("nope", "")


async def test_an_expired_lease_goes_to_the_next_holder(flyd: Flyd, clock: ManualClock) -> None:
    w = flyd.worker
    await create(w, "m1")
    first = await w.acquire_lease("m1", ttl=10, owner="a", description="", nonce="")
    clock.advance(10)
    second = await w.acquire_lease("m1", ttl=10, owner="b", description="", nonce="")
    assert second.nonce != first.nonce
    with pytest.raises(FailedPrecondition, match="leased by b"):
        await w.stop("m1", None, None, lease_nonce=first.nonce)
    await w.release_lease("m1", second.nonce)


async def test_lease_changes_are_in_the_log_and_the_event_stream(flyd: Flyd) -> None:
    w = flyd.worker
    await create(w, "m1")
    stream = Stream(w, flyd.store.last_seq())
    try:
        lease = await w.acquire_lease("m1", ttl=60, owner="deployer", description="", nonce="")
        await w.release_lease("m1", lease.nonce)
        changes = await stream.changes_until(flyd.store.last_seq())
    finally:
        await stream.close()
    assert [(c.event.type, c.machine.lease.owner) for c in changes] == [
        ("lease", "deployer"),
        ("lease", ""),
    ]
    assert [c.event.reason for c in changes] == ["lease held by deployer for 60s", "lease released"]
    assert all(c.event.from_state == c.event.to_state == STARTED for c in changes)
    for change in log_changes(flyd.store):
        assert lease.nonce.encode() not in change.SerializeToString()
    assert [e.type for e in w.events("m1")][-2:] == ["lease", "lease"]
    # Not a state change: the machine's own event tail does not fill up with leases.
    assert "lease" not in {e.type for e in w.get("m1").machine.events}


async def test_a_lease_survives_a_flyd_restart(node: Node) -> None:
    flyd = node.boot()
    await create(flyd.worker, "m1")
    lease = await flyd.worker.acquire_lease(
        "m1", ttl=60, owner="deployer", description="", nonce=""
    )
    row = flyd.worker.get("m1")
    await flyd.kill()

    w = node.boot().worker
    assert w.get("m1").lease == row.lease
    assert w.get("m1").machine.lease == row.machine.lease
    with pytest.raises(FailedPrecondition, match="leased by deployer"):
        await w.stop("m1", None, None)
    assert w.get("m1").handle == row.handle == node.host.live_handle("m1")
    await w.stop("m1", None, None, lease_nonce=lease.nonce)
    await w.wait("m1", STOPPED, DEADLINE)


# --- a real flyd -------------------------------------------------------------------------------

Stub = worker_pb2_grpc.WorkerServiceStub
# Says which greeting it was started with, then serves HTTP on $PORT.
GREETER = "echo greeting=$GREETING; exec python3 -u app.py"


def greeter(greeting: str) -> pb.MachineConfig:
    cfg = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        entrypoint=["sh"],
        cmd=["-c", GREETER],
        env={"GREETING": greeting},
    )
    cfg.services.add(internal_port=8080)
    return cfg


async def logs(stub: Stub, machine_id: str, want: str) -> list[str]:
    """The machine's log once it has a line `want` (the machine may still be starting)."""
    async with asyncio.timeout(30):
        while True:
            lines = [
                r.line
                async for r in stub.GetMachineLogs(
                    wpb.GetMachineLogsRequest(machine_id=machine_id, tail_lines=100), timeout=10
                )
            ]
            if want in lines:
                return lines
            await asyncio.sleep(0.05)  # polling a real process' log file, not timing


async def wait_for(stub: Stub, machine_id: str, state: int, instance_id: str = "") -> pb.Machine:
    request = wpb.WaitMachineRequest(
        machine_id=machine_id,
        state=state,  # type: ignore[arg-type]
        instance_id=instance_id,
        timeout=Duration(seconds=30),
    )
    return (await stub.WaitMachine(request, timeout=35)).machine


async def test_update_and_lease_over_grpc(
    flyd_factory: Callable[..., ServiceProcess], stub_for: Callable[[str], Stub]
) -> None:
    stub = stub_for(flyd_factory().address)
    created = (
        await stub.CreateMachine(
            wpb.CreateMachineRequest(app="demo", config=greeter("v1")), timeout=30
        )
    ).machine
    assert created.state == S.MACHINE_STATE_STARTED
    await logs(stub, created.id, "greeting=v1")

    updating = (
        await stub.UpdateMachine(
            wpb.UpdateMachineRequest(machine_id=created.id, config=greeter("v2")), timeout=30
        )
    ).machine
    assert updating.instance_id != created.instance_id
    machine = await wait_for(stub, created.id, S.MACHINE_STATE_STARTED, updating.instance_id)
    assert (machine.id, machine.config.env["GREETING"]) == (created.id, "v2")
    assert [p.host_port for p in machine.ports] == [p.host_port for p in created.ports]
    assert machine.last_exit.signal == "SIGTERM"  # the old process was stopped
    await logs(stub, created.id, "greeting=v2")

    lease = (
        await stub.AcquireLease(
            wpb.AcquireLeaseRequest(machine_id=created.id, ttl=Duration(seconds=60), owner="me"),
            timeout=10,
        )
    ).lease
    assert lease.nonce
    shown = (await stub.GetMachine(wpb.GetMachineRequest(machine_id=created.id))).machine.lease
    assert (shown.owner, shown.nonce) == ("me", "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StopMachine(wpb.StopMachineRequest(machine_id=created.id), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "leased by me" in (err.value.details() or "")
    assert error_info(err.value) == ("LEASE_HELD", "flyd.nonomad", {})
    assert (await stub.GetMachine(wpb.GetMachineRequest(machine_id=created.id))).machine.state == (
        S.MACHINE_STATE_STARTED
    )
    await stub.StopMachine(
        wpb.StopMachineRequest(machine_id=created.id, lease_nonce=lease.nonce), timeout=10
    )
    await wait_for(stub, created.id, S.MACHINE_STATE_STOPPED)

    events = (
        await stub.ListMachineEvents(
            wpb.ListMachineEventsRequest(machine_id=created.id), timeout=10
        )
    ).events
    types = [e.type for e in events]
    assert types.count("update") == 3
    assert types[-3:] == ["lease", "stop", "stop"]
    await stub.ReleaseLease(
        wpb.ReleaseLeaseRequest(machine_id=created.id, nonce=lease.nonce), timeout=10
    )
    await stub.DestroyMachine(wpb.DestroyMachineRequest(machine_id=created.id), timeout=10)
